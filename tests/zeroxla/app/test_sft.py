"""DeepSpeed-Chat's step 1 with `zeroxla train --init-from HF_DIR --data sft.jsonl`.

References: `transformers` (the pretrained model's logits, in torch) for the response-only loss,
computed in float64 numpy; `transformers` again for the exported model and tokenizer.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

import zeroxla
from zeroxla.app.tiny_checkpoints import gpt2_checkpoint, llama_checkpoint
from zeroxla.app import chat_data, cli
from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer
from zeroxla.app.jobs.train import config
from zeroxla.app.jobs.train import job as train_job
from zeroxla.app.jobs.train.resolve import resolve_job

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 48


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return gpt2_checkpoint(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sft.jsonl"
    chat_data.write_jsonl(chat_data.shakespeare_sft(96, seed=0), path)
    return path


def masked_cross_entropy(logits, targets, mask):
    """float64 numpy: sum over the masked positions of -log softmax(logits)[target], / count."""
    logits = np.asarray(logits, np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float((nll * mask).sum() / mask.sum())


@pytest.mark.parametrize("build", [gpt2_checkpoint, llama_checkpoint], ids=["gpt2", "llama"])
def test_response_only_loss_equals_masked_cross_entropy(build, sft_file, tmp_path):
    directory = build(tmp_path / "hf")
    tokenizer = PretrainedTokenizer.from_dir(directory)
    examples = chat_data.read_sft_jsonl(sft_file)[:8]
    batch = chat_data.sft_arrays(examples, tokenizer, SEQ, eos_id=tokenizer.eos_id)
    assert 0 < batch["loss_mask"].sum() < batch["loss_mask"].size      # prompts are masked out

    mesh = zeroxla.make_mesh(nodes=2, local=4)
    step, state = zeroxla.load_pretrained(directory, mesh, config=zeroxla.ZeroConfig(stage=3),
                                          progress=False)
    _, metrics = step(state, batch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        logits = reference(torch.tensor(batch["inputs"], dtype=torch.long)).logits.numpy()
    want = masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)


@pytest.mark.slow
def test_sft_job_lowers_the_response_loss_and_exports_to_transformers(gpt2_dir, sft_file,
                                                                     tmp_path):
    out = tmp_path / "run"
    job = resolve_job(dict(init_from=str(gpt2_dir), data=str(sft_file), steps=30,
                           batch_size=16, seq_len=SEQ, lr=3e-3, warmup_steps=5, eval_every=30,
                           eval_batches=2, sample_tokens=8, out_dir=str(out), progress=False))
    summary = train_job.run(job, write=lambda line: None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = records[0]["loss"]
    print(f"SFT response loss: step 1 {first:.3f} -> held-out {summary.final_val_loss:.3f}")
    assert summary.final_train_loss < first - 0.5
    assert summary.final_val_loss < first

    export = tmp_path / "export"
    assert cli.main(["export", str(out / "checkpoint"), str(export)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    trained = zeroxla.load_params(out / "checkpoint")
    x = np.random.default_rng(0).integers(0, 512, size=(2, 20)).astype(np.int32)
    with torch.no_grad():
        theirs = exported(torch.tensor(x, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(trained(x)), theirs, atol=1e-4, rtol=0)

    text = "ROMEO:\nWhat light through yonder window breaks?"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    ours = PretrainedTokenizer.from_dir(gpt2_dir)
    assert hf_tokenizer.encode(text, add_special_tokens=False) == ours.encode(text).tolist()


def test_a_tokenizer_that_does_not_match_the_checkpoint_is_refused(gpt2_dir, sft_file,
                                                                   tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in gpt2_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    job = resolve_job(dict(init_from=str(bad), data=str(sft_file), steps=1, seq_len=SEQ,
                           out_dir=str(tmp_path / "run"), progress=False))
    with pytest.raises(ValueError, match="512 ids but .*vocab_size=300"):
        train_job.run(job, write=lambda line: None)
    assert not (tmp_path / "run").exists()            # refused before anything was written


def test_a_response_that_does_not_fit_is_refused_with_its_line(gpt2_dir, tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "Speak.", "response": "word " * 10}) + "\n"
                    + json.dumps({"prompt": "Speak.", "response": "word " * 200}) + "\n")
    job = resolve_job(dict(init_from=str(gpt2_dir), data=str(path), steps=1, seq_len=SEQ,
                           out_dir=str(tmp_path / "run"), progress=False))
    job = dataclasses.replace(job, data=dataclasses.replace(job.data, val_fraction=0.5))
    with pytest.raises(chat_data.ChatDataError, match=r"sft.jsonl:2.*seq_len=48"):
        train_job.run(job, write=lambda line: None)


def test_tokenizer_and_model_options_conflict_with_init_from(gpt2_dir, capsys):
    with pytest.raises(ValueError, match="--tokenizer byte with --init-from"):
        resolve_job(dict(init_from=str(gpt2_dir), tokenizer="byte", progress=False))
    with pytest.raises(ValueError, match="TrainJobConfig.data.tokenizer='byte' with "
                                         "model.init_from="):
        config.TrainJobConfig(model=config.Model(init_from=str(gpt2_dir)),
                              data=config.Data(tokenizer="byte"))
    assert cli.main(["train", "--init-from", str(gpt2_dir), "--model", "gpt-tiny"]) == 2
    assert "--model gpt-tiny with --init-from" in capsys.readouterr().err


LONG = 4096                  # rows of 4K tokens: the blockwise attention's and chunked head's


def _long_examples(tokenizer) -> list:
    """4 examples with responses of 2.0K-2.6K tokens and 4 with 0.3K-1.4K, of tiny-shakespeare
    lines: each long one shares its row with a short one when packed."""
    lines = [e.response for e in chat_data.shakespeare_sft(400, seed=2)]
    rng = np.random.default_rng(5)
    out = []
    for i, (low, high) in enumerate([(2000, 2600)] * 4 + [(300, 1400)] * 4):
        want, response = int(rng.integers(low, high)), ""
        while len(tokenizer.encode(response)) < want:
            response += lines[int(rng.integers(len(lines)))] + "\n"
        out.append(chat_data.SFTExample(f"Speak, {i}.", response))
    return out


@pytest.mark.slow
def test_long_packed_sft_equals_transformers_and_trains_end_to_end(tmp_path):
    """Responses of up to 2.6K tokens, packed into 4,096-token rows: the ZeRO-3 step's loss on
    the packed rows equals transformers' masked cross-entropy of the examples one by one
    (float64 numpy), and `zeroxla train` on them runs end to end."""
    directory = llama_checkpoint(tmp_path / "hf", max_positions=LONG)
    tokenizer = PretrainedTokenizer.from_dir(directory)
    examples = _long_examples(tokenizer)
    packed = chat_data.sft_arrays(examples, tokenizer, LONG, eos_id=tokenizer.eos_id,
                                  packed=True)
    rows = len(packed["inputs"])
    assert rows == 4                               # 8 examples, one row per device
    batch = packed
    mesh = zeroxla.make_mesh(nodes=2, local=2, devices=jax.devices()[:4])   # 4 of the 8
    step, state = zeroxla.load_pretrained(directory, mesh, config=zeroxla.ZeroConfig(stage=3),
                                          progress=False)
    _, metrics = step(state, batch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    total = count = 0.0
    for example in examples:                       # one example per forward: no packing at all
        row = chat_data.sft_arrays([example], tokenizer, LONG, eos_id=tokenizer.eos_id)
        k = int(np.flatnonzero(row["loss_mask"][0]).max()) + 1
        with torch.no_grad():
            logits = reference(torch.tensor(row["inputs"][:, :k], dtype=torch.long)).logits
        mask = row["loss_mask"][:, :k]
        total += masked_cross_entropy(logits.numpy(), row["targets"][:, :k], mask) * mask.sum()
        count += mask.sum()
    np.testing.assert_allclose(float(metrics["loss"]), total / count, rtol=1e-5)

    data = tmp_path / "long.jsonl"
    chat_data.write_jsonl(examples, data)
    job = resolve_job(dict(init_from=str(directory), data=str(data), steps=1, batch_size=4,
                           mesh=(2, 2), seq_len=LONG, lr=1e-3, warmup_steps=1, eval_batches=1,
                           sample_tokens=0, out_dir=str(tmp_path / "run"), progress=False))
    lines = []
    summary = train_job.run(job, write=lines.append)
    assert any("packed into" in line for line in lines), lines
    assert np.isfinite(summary.final_train_loss) and np.isfinite(summary.final_val_loss)

"""The families through the jobs: `zeroxla train --init-from` (SFT on the bundled
tiny-shakespeare pairs, with its end-of-run sample) and `zeroxla export` on a tiny Llama 3.x
(llama3 rope scaling, tied), mistral (a sliding window shorter than the sequence), qwen2 (tied
embedding, q/k/v biases) and gemma2 (soft-capping, alternating sliding and global layers,
tied); two `zeroxla ppo` iterations on a tiny qwen3 (q/k norms, explicit head_dim, untied) with
a transformers `Qwen3ForSequenceClassification` as the reward model; `zeroxla reward
--init-from` and its export as a `*ForSequenceClassification` for every family. Each
checkpoint is written by transformers with the fixture tokenizer (no network).

Reference: transformers itself. Its loss of the source checkpoint on the job's first batch
(rebuilt by the job's own reader, packed as train packs SFT rows by default: each packed example
given to transformers alone) is the first training loss of every `zeroxla train`; its loss
of the reloaded export on the validation batch is the job's last validation loss, and its
pairwise loss of an exported reward model on the validation pairs the reward job's; the
export's logits equal the trained checkpoint's, its config keeps the family's model_type and
tie, and its tokenizer encodes as the source checkpoint's does.
"""

import json

import numpy as np
import pytest

import zeroxla
from zeroxla.app.jobs import loading
from zeroxla.app import chat_data, cli
from zeroxla.app.packing import PAD_SEGMENT
from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer
from zeroxla.app.jobs.train.config import Data, Run
from zeroxla.app.data import epoch_rows, split_examples
from zeroxla.app.jobs.train.data import VALIDATION_SEED, load_train_data
from zeroxla.app.tiny_checkpoints import eos_id, tokenizer_vocab_size, write_tokenizer
from family_checkpoints import save_random

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
SEQ = 48
SFT_SEQ = 2 * SEQ     # train's rows: room for several of the ~30-token SFT examples, so the
                      # packed rows (train's default) hold more than one and attention must
                      # keep each to itself
COMMON = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
              tie_word_embeddings=True)
# family -> (transformers config class, its options)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_parameters=LLAMA3)),      # Llama 3.2's shape: tied
    "mistral": ("MistralConfig", dict(sliding_window=5)),
    "qwen2": ("Qwen2Config", {}),                 # q/k/v biases are Qwen2's own
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=12, sliding_window=5,
                                    attn_logit_softcapping=20.0,
                                    final_logit_softcapping=10.0)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False)),
}


def write_checkpoint(family, directory, reward=False):
    """A random transformers checkpoint of `family` (`family_checkpoints.save_random`) with the
    fixture tokenizer; `reward`: its one-label sequence classifier padded with EOS, as TRL saves
    a reward model."""
    cls_name, options = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, cls_name)(
        **{**COMMON, **options}, vocab_size=tokenizer_vocab_size(), bos_token_id=eos_id(),
        eos_token_id=eos_id(), pad_token_id=eos_id() if reward else None,
        **({"num_labels": 1} if reward else {}))
    auto = (transformers.AutoModelForSequenceClassification if reward
            else transformers.AutoModelForCausalLM)
    save_random(auto.from_config(config), directory)
    write_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sft.jsonl"
    chat_data.write_jsonl(chat_data.shakespeare_sft(64, seed=0), path)
    return path


def causal_lm(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def logits(directory, x, model=None):
    """transformers' logits [B, T, V] of `x` [B, T] (`model`: `directory`'s, already loaded)."""
    with torch.no_grad():
        model = causal_lm(directory) if model is None else model
        return model(torch.tensor(x, dtype=torch.long)).logits.numpy()


def tokens():
    return np.random.default_rng(0).integers(0, tokenizer_vocab_size(), (2, 20)).astype(np.int32)


def job_rows(source, sft_file, batch_size=8):
    """The rows `zeroxla train --init-from source --data sft_file` trains on first and
    validates on (its defaults: `Data.val_fraction`, `Run.seed`, `Data.packing`: training rows
    packed with segment ids, validation rows padded), from the job's own reader."""
    data = load_train_data(str(sft_file), tokenizer="pretrained", init_from=str(source),
                           batch_size=batch_size, seq_len=SFT_SEQ, val_fraction=Data.val_fraction,
                           seed=Run.seed, packing=Data.packing)
    return (epoch_rows(data.train, batch_size, 0, data.seed),
            epoch_rows(data.val, batch_size, 0, VALIDATION_SEED))


def sequences(rows):
    """(inputs, targets, loss_mask), each [L], of every sequence in `rows`: a padded row whole;
    a packed row's examples (`segment_ids`, 0: padding) one by one, each from position 0."""
    keys = ("inputs", "targets", "loss_mask")
    for r in range(len(rows["inputs"])):
        if "segment_ids" not in rows:
            yield tuple(rows[key][r] for key in keys)
            continue
        ids = rows["segment_ids"][r]
        for segment in np.unique(ids[ids != PAD_SEGMENT]):
            yield tuple(rows[key][r, ids == segment] for key in keys)


def transformers_loss(directory, rows):
    """transformers' SFT loss of checkpoint `directory` on `rows`: -log p(target) from its
    logits, in float64, averaged over the loss_mask tokens of all rows. Each sequence
    (`sequences`: a packed example alone, so it attends to itself only) is its own forward."""
    model, total, count = causal_lm(directory), 0.0, 0.0
    for inputs, targets, mask in sequences(rows):
        z = logits(directory, inputs[None], model)[0].astype(np.float64)   # [L, V]
        top = z.max(-1, keepdims=True)
        logp = z - top - np.log(np.exp(z - top).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, targets[:, None].astype(np.int64), -1)[:, 0]
        total, count = total + float((nll * mask).sum()), count + float(mask.sum())
    return total / count


@pytest.mark.parametrize("family", ["gemma2", "llama", "mistral", "qwen2"])   # qwen3: PPO's
def test_train_init_from_then_export_reloads_in_transformers(family, sft_file, tmp_path, capsys):
    source = write_checkpoint(family, tmp_path / "hf")
    out = tmp_path / "run"
    assert cli.main(["train", "--init-from", str(source), "--data", str(sft_file),
                     "--steps", "3", "--batch-size", "8", "--seq-len", str(SFT_SEQ),
                     "--lr", "1e-3", "--eval-every", "3", "--eval-batches", "1",
                     "--sample-tokens", "8", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]              # eval records have none
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    first_batch, val_batch = job_rows(source, sft_file)
    assert first_batch["loss_mask"].sum() > 0 and val_batch["loss_mask"].sum() > 0
    assert (first_batch["segment_ids"].max(-1) > 1).any()     # train packs: rows of examples
    np.testing.assert_allclose(losses[0], transformers_loss(source, first_batch), rtol=1e-5)
    printed = capsys.readouterr().out
    assert summary["samples"].strip()                      # the end-of-run sample, printed
    assert all(line in printed for line in summary["samples"].splitlines())

    export = tmp_path / "export"
    assert cli.main(["export", str(out / "checkpoint"), str(export)]) == 0
    written = json.loads((export / "config.json").read_text())
    assert written["model_type"] == family and written["tie_word_embeddings"] is True
    if family == "llama":
        assert written["rope_parameters"]["rope_type"] == "llama3"
    x = tokens()
    exported, trained = logits(export, x), zeroxla.load_params(out / "checkpoint")(x)
    np.testing.assert_allclose(exported, np.asarray(trained), atol=1e-4, rtol=0)
    assert np.abs(exported - logits(source, x)).max() > 1e-3    # the export is the trained model
    val_losses = [r["val_loss"] for r in records if "val_loss" in r]
    np.testing.assert_allclose(val_losses[-1], transformers_loss(export, val_batch), rtol=1e-5)

    text = "ROMEO:\nWhat light through yonder window breaks?"
    theirs = transformers.AutoTokenizer.from_pretrained(export)
    ours = PretrainedTokenizer.from_dir(source)
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text).tolist()


def test_two_ppo_iterations_on_qwen3_export_a_qwen3_actor(tmp_path, sft_file):
    source = write_checkpoint("qwen3", tmp_path / "hf")
    reward = write_checkpoint("qwen3", tmp_path / "rm", reward=True)
    prompts = tmp_path / "prompts.jsonl"
    chat_data.write_jsonl(chat_data.shakespeare_prompts(16, seed=2), prompts)
    assert cli.main(["train", "--init-from", str(source), "--data", str(sft_file), "--steps", "1",
                     "--batch-size", "8", "--seq-len", str(SFT_SEQ), "--eval-every", "1",
                     "--eval-batches", "1", "--sample-tokens", "0", "--out", str(tmp_path / "sft"),
                     "--no-progress"]) == 0
    sft_records = (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
    np.testing.assert_allclose(json.loads(sft_records[0])["loss"],
                               transformers_loss(source, job_rows(source, sft_file)[0]), rtol=1e-5)
    out = tmp_path / "ppo"
    assert cli.main(["ppo", "--actor", str(tmp_path / "sft"), "--reward", str(reward),
                     "--prompts", str(prompts), "--iterations", "2", "--ppo-epochs", "1",
                     "--per-iteration-prompts", "8", "--max-prompt-seq-len", "8",
                     "--max-answer-seq-len", "12", "--out", str(out), "--no-progress"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    written = json.loads((out / "actor_hf" / "config.json").read_text())
    assert written["model_type"] == "qwen3" and written["tie_word_embeddings"] is False
    x = tokens()
    exported = logits(out / "actor_hf", x)
    np.testing.assert_allclose(exported,
                               np.asarray(zeroxla.load_params(out / "checkpoint" / "actor")(x)),
                               atol=1e-4, rtol=0)
    sft = np.asarray(zeroxla.load_params(tmp_path / "sft" / "checkpoint")(x))
    assert np.abs(exported - sft).max() > 1e-4                  # PPO moved the actor


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reward_job_exports_a_classifier_that_transformers_scores_alike(family, tmp_path,
                                                                      capsys):
    """`zeroxla reward --init-from` the family's causal checkpoint, 2 steps, then `zeroxla
    export`: a one-label `*ForSequenceClassification` of the family whose score, pooled by
    transformers at each row's last token, equals our trained reward model's there, and whose
    pairwise loss on the validation pairs, from transformers' scores at each answer's last
    token, is the job's last `val_loss`."""
    from zeroxla.app.jobs import reward as reward_job

    source = write_checkpoint(family, tmp_path / "hf")
    pairs = tmp_path / "pairs.jsonl"
    chat_data.write_jsonl(chat_data.shakespeare_pairs(64, seed=1), pairs)
    out = tmp_path / "rm"
    assert cli.main(["reward", "--init-from", str(source), "--data", str(pairs), "--steps", "2",
                     "--batch-size", "8", "--seq-len", str(SEQ), "--eval-every", "2",
                     "--out", str(out), "--no-progress"]) == 0
    export = tmp_path / "export"
    assert cli.main(["export", str(out / "checkpoint"), str(export)]) == 0
    capsys.readouterr()
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == family and len(config["id2label"]) == 1
    assert config["architectures"] == [FAMILIES[family][0].replace(
        "Config", "ForSequenceClassification")]
    x = tokens()                                    # ids of the tokenizer: none is the pad id
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(export).eval()
    with torch.no_grad():
        pooled = theirs(torch.tensor(x, dtype=torch.long)).logits.numpy()[:, 0]
    ours, _ = loading.load_reward_model(out)
    np.testing.assert_allclose(pooled, np.asarray(ours(x))[:, -1], atol=1e-4, rtol=0)
    assert np.abs(pooled).max() > 1e-3                      # the trained head is not zero

    job = reward_job.RewardJobConfig                         # the job's defaults
    tok = PretrainedTokenizer.from_dir(source)
    val = chat_data.pair_arrays(split_examples(chat_data.read_pair_jsonl(pairs), job.val_fraction,
                                               job.run.seed)[1], tok, SEQ, eos_id=tok.eos_id)

    def scores(key):                                        # [N] at each answer's last token
        with torch.no_grad():
            hidden = theirs.base_model(torch.tensor(val[key], dtype=torch.long)).last_hidden_state
            s = theirs.score(hidden).numpy()[..., 0].astype(np.float64)
        return s[np.arange(len(s)), val[f"{key}_end"]]
    want = np.mean(np.logaddexp(0.0, scores("rejected") - scores("chosen")))   # -log sigmoid
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(records[-1]["val_loss"], want, rtol=1e-5)

"""Export: checkpoint -> Hugging Face safetensors, streamed one tensor at a time.

A GPT (4 layers, d_model 128) trained nowhere but checkpointed from ZeRO-3 on 2 x 4 devices,
and llama-tiny from ZeRO-0 on one device; both exported, re-imported with `models.hf`, and run.
And a `zeroxla train` run, exported with its tokenizer and loaded by `transformers`.
"""

import json
import shutil
import stat
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from zeroxla import models
from zeroxla.models import hf
from bitrot import flip_data_bytes
from reference import flat_params
from zeroxla import checkpoint
from zeroxla.sharding.config import ZeroConfig
from zeroxla.app import cli
from zeroxla.checkpoint.export import export_checkpoint
from zeroxla.sharding.mesh import make_mesh
from zeroxla.engine.state import gather_params
from zeroxla.make import make_step

GPT = models.GPTConfig(d_model=128, num_heads=4, num_layers=4, mlp_dim=512)
TOKENS = np.random.default_rng(0).integers(0, 65, (2, 16)).astype(np.int32)


def _checkpoint(directory, config, mesh, stage):
    cls = models.GPT if config.family == "gpt2" else models.Llama
    step = make_step(lambda: cls(config, rngs=nnx.Rngs(3)), mesh,
                     config=ZeroConfig(stage=stage, persistence_threshold=500))
    state = step.init()
    checkpoint.save(directory, state, layout=step.layout)
    params = flat_params(gather_params(state))
    return directory, params


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("gpt"), GPT, make_mesh(2, 4), stage=3)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    return _checkpoint(tmp_path_factory.mktemp("llama"), models.LlamaConfig.tiny(), mesh, 0)


def _logits(config, params):
    return np.asarray(hf.model_from_params(config, params)(TOKENS))


@pytest.mark.parametrize("family", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_export_import_round_trip_gives_identical_logits(request, tmp_path, family):
    directory, params = request.getfixturevalue(family)
    files = export_checkpoint(directory, tmp_path, max_shard_size="200KB")
    config, model = hf.load_hf_model(tmp_path)
    assert config == (GPT if family == "gpt" else models.LlamaConfig.tiny())
    np.testing.assert_array_equal(np.asarray(model(TOKENS)), _logits(config, params))
    if family == "gpt":                                   # sharded: index + several shards
        index = json.loads((tmp_path / hf.INDEX_FILE).read_text())
        assert "transformer.h.3.attn.c_attn.weight" in index["weight_map"]
        assert len([f for f in files if f.suffix == ".safetensors"]) > 5


def test_bfloat16_export(llama, tmp_path):
    directory, params = llama
    export_checkpoint(directory / "0", tmp_path, dtype="bfloat16")     # a step directory
    with safe_open(str(tmp_path / hf.SINGLE_FILE), framework="numpy") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(embed, params["embed/weight"].astype(ml_dtypes.bfloat16))
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_export_streams_tensor_by_tensor(gpt, tmp_path):
    """Host memory peaks near one shard plus a couple of the largest tensor, not the model."""
    directory, params = gpt
    shard = 300_000
    rules = hf.hf_name_map(GPT)
    largest = max(np.asarray(r.to_hf(*(params[p][0] if r.per_layer else params[p]
                                       for p in r.ours))).nbytes for r in rules)
    total = sum(v.nbytes for v in params.values())
    export_checkpoint(directory, tmp_path / "warm", max_shard_size=shard)   # imports, caches
    tracemalloc.start()
    try:
        export_checkpoint(directory, tmp_path / "out", max_shard_size=shard)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"export peak {peak} B; largest tensor {largest} B, shard {shard} B, model {total} B")
    assert total > 3 * (shard + 2 * largest)           # the bound below is a real constraint
    assert peak < shard + 2 * largest + 64 * 1024, (peak, shard, largest, total)


def test_cli_export(llama, tmp_path, capsys):
    directory, _ = llama
    args = cli.build_parser().parse_args(["export", str(directory), str(tmp_path), "--dtype", "float32",
                              "--max-shard-size", "100000"])
    assert args.handler(args) == 0
    assert "model-00001-of-" in capsys.readouterr().out
    assert (tmp_path / hf.INDEX_FILE).exists()


def test_export_of_corrupted_checkpoint_raises(llama, tmp_path):
    """Bytes flipped in the stored data (not the metadata) are caught by the arrays' checksums;
    export reads only the parameters, so the flips are spread over every data file."""
    directory = tmp_path / "ck"
    shutil.copytree(llama[0], directory)
    assert flip_data_bytes(directory / "0" / "state")
    with pytest.raises(checkpoint.CorruptCheckpointError, match="fails its checksum|cannot read"):
        export_checkpoint(directory, tmp_path / "out")


# ---- a zeroxla train run, exported with its tokenizer, loaded by transformers --------------------

@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """gpt-tiny trained 3 steps by `zeroxla train`'s job (character tokenizer)."""
    from zeroxla.app.jobs.train import job as train_job
    from zeroxla.app.jobs.train.resolve import resolve_job

    job = resolve_job(dict(steps=3, batch_size=8, seq_len=32, eval_batches=1, sample_tokens=0,
                           progress=False,
                           out_dir=str(tmp_path_factory.mktemp("train") / "run")))
    train_job.run(job, write=lambda line: None)
    return job


@pytest.mark.slow
def test_trained_run_exports_a_model_and_tokenizer_transformers_loads(trained_run, tmp_path,
                                                                      capsys):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    import zeroxla
    from zeroxla.app.data import load_corpus
    from zeroxla.app.jobs.train.recipe import build_setup

    run_checkpoint = f"{trained_run.run.out_dir}/checkpoint"
    out = tmp_path / "hf"
    assert cli.main(["export", run_checkpoint, str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["step"] == 3 and printed["tokenizer"] == "char (65 ids)"
    assert {hf.SINGLE_FILE, "config.json", "tokenizer.json", "tokenizer_config.json"} == {
        p.name for p in out.iterdir()} == set(printed["files"])
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        name: 0o644 for name in printed["files"]}

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "ROMEO:\nBut, soft! what light through yonder window breaks?\n  It is the east."
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert ids == load_corpus().tokenizer.encode(text).tolist()      # the run's own ids

    # Our model: the checkpoint restored with the run's optimizer, gathered by the engine.
    restored = zeroxla.restore(run_checkpoint, (make_mesh(2, 4), None),
                               optimizer=build_setup(trained_run).optimizer)
    ours = zeroxla.gathered_model(restored.state)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = np.asarray(ids[:20], np.int32)[None]                     # [1, 20]
    with torch.no_grad():
        generated = theirs.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=8,
                                    do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
    sequence = generated.sequences.numpy().astype(np.int32)           # [1, 28]
    assert sequence.shape == (1, 28) and (sequence[:, :20] == prompt).all()
    assert tokenizer.decode(sequence[0]).startswith(text[:20])
    # generate's logits for each new token = ours at the same position, on the same ids.
    their_logits = np.stack([step.numpy()[0] for step in generated.logits])     # [8, V]
    our_logits = np.asarray(ours(sequence[:, :-1]))[0, 19:]                      # [8, V]
    np.testing.assert_allclose(their_logits, our_logits, atol=1e-4)


@pytest.mark.slow          # load_params of run checkpoints is daily in the tests/zeroxla/app jobs
def test_load_params_of_a_cli_checkpoint_equals_the_restored_state(trained_run):
    """`zeroxla.load_params` needs no optimizer and no mesh; its model computes the logits of the
    full restore (with the job's optimizer) gathered into a plain model."""
    import zeroxla
    from zeroxla.app.jobs.train.recipe import build_setup

    directory = f"{trained_run.run.out_dir}/checkpoint"
    loaded = zeroxla.load_params(directory)
    restored = zeroxla.restore(directory, (make_mesh(2, 4), None),
                               optimizer=build_setup(trained_run).optimizer)
    tokens = np.random.default_rng(0).integers(0, 65, (2, 16)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(loaded(tokens)),
                                  np.asarray(zeroxla.gathered_model(restored.state)(tokens)))
    fresh = models.build(trained_run.model.preset)                    # untrained weights differ
    assert np.abs(np.asarray(fresh(tokens)) - np.asarray(loaded(tokens))).max() > 1e-3
    with pytest.raises(ValueError, match=r"'params/.*' has shape .*, the model's is"):
        zeroxla.load_params(directory, model=lambda: models.build("gpt-small"))

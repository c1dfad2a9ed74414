"""zeroxla.load_pretrained: a Hugging Face checkpoint straight into ZeRO partitions.

References: `transformers` itself (the same checkpoint's logits and loss in torch) and the
checkpoint's own tensor sizes (the host-memory bound). The checkpoints are tiny random GPT-2 and
Llama models written by `transformers` (zeroxla/app/tiny_checkpoints.py), every parameter
drawn at std 0.1 (norm scales around 1), so that a wrong mapping moves the logits by far more
than the tolerance (swapping Llama's gate and up projections: by 2.75, against 1e-4).
"""

import json
import tracemalloc

import numpy as np
import optax
from flax import nnx
import pytest
from jax.sharding import NamedSharding

import zeroxla
from zeroxla.app.tiny_checkpoints import gpt2_checkpoint, llama_checkpoint
from runs import device_bytes
from zeroxla.checkpoint.pretrained import (device_part, owned_index, place, spread_hf_params,
                                           spread_spec, stage_layers)
from zeroxla.models import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4            # float32 logits, ours vs transformers
BUILDERS = {"gpt2": gpt2_checkpoint, "llama": llama_checkpoint}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> directory of a sharded (index + several files) tiny random checkpoint."""
    return {family: build(tmp_path_factory.mktemp(family), sharded=True)
            for family, build in BUILDERS.items()}


def torch_model(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def tokens(directory, shape, seed=0):
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


def test_the_fixture_is_sharded_with_an_index(checkpoints):
    for directory in checkpoints.values():
        assert (directory / hf.INDEX_FILE).exists()
        assert len(list(directory.glob("model-*-of-*.safetensors"))) >= 2


def _slow_unless(representative, *values):  # values: family, mesh shape, stage
    """The parameters, marked slow except the daily subset's one representative."""
    family, mesh, stage = values
    return pytest.param(*values, marks=() if representative else pytest.mark.slow,
                        id=f"{family}-{mesh[0]}x{mesh[1]}-stage{stage}")


@pytest.mark.parametrize("family,mesh_shape,stage", [
    _slow_unless(family == "gpt2" and mesh == (2, 4) and stage == 3, family, mesh, stage)
    for family in sorted(BUILDERS) for mesh in ((2, 4), (1, 8)) for stage in (1, 3)])
def test_loaded_logits_and_first_loss_equal_transformers(checkpoints, family, mesh_shape, stage):
    directory = checkpoints[family]
    mesh = zeroxla.make_mesh(nodes=mesh_shape[0], local=mesh_shape[1])
    step, state = zeroxla.load_pretrained(directory, mesh, optimizer=optax.adamw(1e-3),
                                          config=zeroxla.ZeroConfig(stage=stage),
                                          progress=False)
    reference = torch_model(directory)

    x = tokens(directory, (2, 24))
    ours = np.asarray(zeroxla.gathered_model(state)(x))
    with torch.no_grad():
        theirs = reference(torch.tensor(x, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)

    # The step's first loss is computed before its update: transformers' loss with labels = the
    # same tokens (it shifts them by one, as our inputs/targets split does).
    seq = tokens(directory, (8, 17), seed=1)
    _, metrics = step(state, {"inputs": seq[:, :-1], "targets": seq[:, 1:]})
    with torch.no_grad():
        t = torch.tensor(seq, dtype=torch.long)
        want = reference(t, labels=t).loss.item()
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)


@pytest.fixture(scope="module")
def llama_on_2x4(checkpoints):
    """(step, state) of the Llama checkpoint loaded on the 2 x 4 mesh, ZeRO-3 with every leaf
    partitioned: each tensor read in pieces and spread over both nodes."""
    mesh = zeroxla.make_mesh(nodes=2, local=4)
    config = zeroxla.ZeroConfig(stage=3, persistence_threshold=0)
    return zeroxla.load_pretrained(checkpoints["llama"], mesh, config=config, progress=False)


def test_loaded_llama_logits_equal_transformers_on_2x4(checkpoints, llama_on_2x4):
    """The daily subset's Llama load (the step-and-loss check above runs it in the full
    suite): GQA, the SwiGLU gate/up/down projections and the untied head, every one a
    transposed nn.Linear, gathered from their ZeRO-3 partitions, give transformers' logits."""
    _, state = llama_on_2x4
    x = tokens(checkpoints["llama"], (2, 24))
    with torch.no_grad():
        theirs = torch_model(checkpoints["llama"])(torch.tensor(x, dtype=torch.long)).logits
    ours = np.asarray(zeroxla.gathered_model(state)(x))
    assert theirs.numpy().std() > 0.5        # weights of std 0.1: logits of spread ~0.8, not ~0
    np.testing.assert_allclose(ours, theirs.numpy(), atol=ATOL, rtol=0)


def test_the_state_is_partitioned_as_a_fresh_init(llama_on_2x4):
    """Loading places the parameters exactly where `init` would: the same bytes on every
    device, and with every leaf partitioned, 1/8 of the model each (up to padding)."""
    step, state = llama_on_2x4
    loaded = device_bytes(state.params)
    assert loaded == device_bytes(step.init().params)
    total = 4 * sum(leaf.numel for leaf in step.layout.plan.leaves)
    padding = 4 * sum(leaf.padding for leaf in step.layout.plan.leaves)
    assert set(loaded.values()) == {(total + padding) // 8}
    print(f"per device {(total + padding) // 8} B of a {total} B model")


def test_host_memory_stays_near_one_tensor(tmp_path):
    """The host never holds the model: while the tensors go to the devices, the traced host
    peak stays under 2x the largest single HF tensor plus a fixed 256 KiB (Python objects,
    safetensors' file handles). The checkpoint has 8 layers, so the model is several times
    its largest tensor and a whole-model read could not pass. Measured after a first load, so
    that compiling the stacking programs is not counted."""
    directory = llama_checkpoint(tmp_path, sharded=True, num_layers=8)
    config = hf.from_hf_config(hf.read_hf_config(directory))
    sizes = {}
    with hf.open_safetensors(directory) as get_tensor:
        index = json.loads((directory / hf.INDEX_FILE).read_text())["weight_map"]
        for name in index:
            sizes[name] = get_tensor(name).astype(np.float32).nbytes
    largest, total = max(sizes.values()), sum(sizes.values())
    assert total > 6 * largest

    mesh = zeroxla.make_mesh(nodes=2, local=4)
    spread_hf_params(config, directory, mesh, progress=False)         # compiles the stacking
    tracemalloc.start()
    try:
        values = spread_hf_params(config, directory, mesh, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(values) == len(hf.param_dict(zeroxla.models.abstract_model(config)))
    print(f"host peak {peak} B; largest tensor {largest} B; model {total} B")
    assert peak < 2 * largest + 256 * 1024


def test_unsupported_architecture_is_refused_by_name(checkpoints, tmp_path):
    config = json.loads((checkpoints["gpt2"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    mesh = zeroxla.make_mesh(nodes=2, local=4)
    with pytest.raises(ValueError, match=r"model_type='bert' is not supported; "
                                         r"zeroxla builds gemma2, gemma3, gemma4, gpt2, gpt_oss, "
                                         r"llama, mistral, mixtral, olmoe, qwen2, qwen2_moe, "
                                         r"qwen3, qwen3_5, qwen3_5_moe, qwen3_moe"):
        zeroxla.load_pretrained(tmp_path, mesh, progress=False)
    (tmp_path / "config.json").write_text(json.dumps({**config, "activation_function": "relu"}))
    with pytest.raises(ValueError, match=f"{tmp_path}.*activation_function='relu'"):
        zeroxla.load_pretrained(tmp_path, mesh, progress=False)


def test_a_directory_without_config_is_refused(tmp_path):
    mesh = zeroxla.make_mesh(nodes=2, local=4)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        zeroxla.load_pretrained(tmp_path, mesh, progress=False)


def _init_temp_bytes(step, values):
    """Temporaries of the program `init_from` runs on `values` (`memory_analysis()`)."""
    return step._jitted_init.lower(values, {}, step._seed(0)).compile().memory_analysis(
        ).temp_size_in_bytes


@pytest.mark.slow
@pytest.mark.parametrize("num_layers,split", [(4, (2, 2)), (3, (2, 1))], ids=["even", "uneven"])
def test_a_pipelined_load_builds_its_state_without_gathering_a_stacked_leaf(
        tmp_path, capfd, num_layers, split):
    """On a 2-stage x 4 mesh the loaded pieces are spread over one stage's 4 devices and, where
    the stages hold equally many layers, the stacked leaves split over the stages as loaded
    (each device 1/8 of each), so `init_from` lays them out without moving layers between
    stages. Its compiled program then needs no more temporaries than the unpipelined load's on
    2 x 4, and XLA's partitioner never falls back to replicating a leaf whole ("Involuntary
    full rematerialization", which it logs when it cannot reshard: what spreading every piece
    over all 8 devices made it do for every stacked leaf)."""
    directory = llama_checkpoint(tmp_path, num_layers=num_layers)
    config = hf.from_hf_config(hf.read_hf_config(directory))

    def load(mesh, pipeline):
        step = zeroxla.make_step(
            lambda: zeroxla.models.model_class(config)(config, rngs=nnx.Rngs(0)), mesh,
            optimizer=optax.adamw(1e-3), config=zeroxla.ZeroConfig(stage=3),
            pipeline=pipeline)
        return step, spread_hf_params(config, directory, mesh, progress=False,
                                      stage_layers=stage_layers(step))

    plain_step, plain_values = load(zeroxla.make_mesh(2, 4), None)
    step, values = load(zeroxla.make_mesh(1, 4, stages=2), zeroxla.PipelineConfig(2))
    assert stage_layers(step) == split
    for path, value in values.items():
        spec = value.sharding.spec
        if step.layout.plan[path].stacked:
            assert (spec[0] == "stage") == (split[0] == split[1]), (path, spec)
            if split[0] == split[1]:
                assert {s.data.nbytes for s in value.addressable_shards} == {value.nbytes // 8}
        assert "stage" not in (spec[1:] if spec else ())          # a stage's devices only
    capfd.readouterr()
    temp = _init_temp_bytes(step, values)
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    assert temp <= _init_temp_bytes(plain_step, plain_values)


# ---- several processes: each reads only what its devices hold -----------------------------------

def test_owned_index_is_the_rows_of_the_given_devices():
    """On the 2 x 4 mesh a [512, 64] table is spread by rows, 64 per device in mesh order: the
    first node's four devices hold rows 0..255, the second's 256..511; all eight, everything."""
    mesh = zeroxla.make_mesh(nodes=2, local=4)
    first, second = list(mesh.devices[0]), list(mesh.devices[1])
    assert owned_index((512, 64), mesh, first) == (slice(0, 256), slice(None))
    assert owned_index((512, 64), mesh, second) == (slice(256, 512), slice(None))
    assert owned_index((512, 64), mesh, first + second) is None
    assert owned_index((3,), mesh, first) is None                    # replicated: read whole


@pytest.mark.parametrize("shape,part_index,first_half,second_half", [
    ((512, 64), (slice(256, 512), slice(None)), "[0:256, 0:64]", "[256:512, 0:64]"),
    ((5, 64), (slice(None), slice(32, 64)), "[0:5, 0:32]", "[0:5, 32:64]")],
    ids=["rows", "columns"])
def test_a_part_read_at_an_offset_gives_each_device_its_block(shape, part_index, first_half,
                                                              second_half):
    """What the second of two processes does, in one: it reads only the part `owned_index`
    names for the second node's devices (rows 256..511 of a [512, 64] table; columns 32..63 of
    a [5, 64] piece, spread on its only dim that 8 divides), and each of those devices gets its
    block of the full tensor (numpy's slice of it), the part's offset taken off. A block the
    part does not hold (a first-node device's) is refused, by `place` too, never cut short:
    `place` (one process, all 8 devices) names exactly the first node's half, the slice the
    part lacks once its offset is taken off (a placement that ignored the offset would cut the
    first node's blocks from the part and refuse the second node's instead)."""
    mesh = zeroxla.make_mesh(nodes=2, local=4)
    full = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    second = list(mesh.devices[1])
    index = owned_index(shape, mesh, second)
    assert index == part_index
    part = full[index]
    blocks = NamedSharding(mesh, spread_spec(shape, mesh)).devices_indices_map(shape)
    for device in second:
        np.testing.assert_array_equal(device_part(part, blocks[device], shape, index),
                                      full[blocks[device]], err_msg=str(device))
    with pytest.raises(ValueError, match=r"lies outside the part"):
        device_part(part, blocks[mesh.devices[0][0]], shape, index)
    with pytest.raises(ValueError, match=r"lies outside the part") as refused:
        place(part, mesh, np.float32, shape=shape, index=index)   # one process: all 8 devices
    assert (f"the slice {first_half} of a {list(shape)} array that this process's devices hold "
            f"lies outside the part {second_half} read for them") in str(refused.value)
    np.testing.assert_array_equal(np.asarray(place(full, mesh, np.float32)), full)


def test_a_selected_part_is_read_from_the_file_as_stored(checkpoints):
    """`iter_hf_params(select=...)` reads only the selected rows of the tensors stored as they
    are (embeddings, norms, Conv1D weights), equal to the same rows of transformers' tensors;
    the others come whole."""
    directory = checkpoints["gpt2"]
    config = hf.from_hf_config(hf.read_hf_config(directory))
    reference = {k: v.numpy() for k, v in torch_model(directory).state_dict().items()}
    parted = 0
    with hf.open_safetensors(directory) as reader:
        for path, layer, piece, index in hf.iter_hf_params(
                config, hf.NameFallbacks(reader, {}),
                select=lambda shape: (slice(0, shape[0] // 2),) + (slice(None),) * (len(shape) - 1)):
            if path == "embed/wte":
                np.testing.assert_array_equal(piece, reference["transformer.wte.weight"][:256])
            if index is not None:
                parted += 1
                assert piece.shape[0] * 2 == hf.param_shapes(config)[path][1 if layer is not None
                                                                           else 0]
    assert parted >= 10                         # wte, wpe, norms, biases, mlp weights per layer


@pytest.mark.slow
def test_two_processes_load_and_train_as_one(checkpoints, tmp_path):
    """`zeroxla launch --nproc 2 -- zeroxla train --init-from HF_DIR`: each process reads only
    its half of the tensors stored as they are; the losses equal one process's (which equal
    transformers' above)."""
    import subprocess

    from commands import cpu_env, zeroxla_command
    from zeroxla.app import chat_data, cli
    from zeroxla.app.run import rundir

    data = tmp_path / "sft.jsonl"
    chat_data.write_jsonl(chat_data.shakespeare_sft(64, seed=0), data)
    job = ["train", "--init-from", str(checkpoints["gpt2"]), "--data", str(data), "--steps",
           "3", "--batch-size", "16", "--seq-len", "48", "--eval-every", "3",
           "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]
    result = subprocess.run(
        zeroxla_command("launch", "--nproc", "2", "--devices-per-proc", "4", "--",
                        *zeroxla_command(*job, "--out", str(tmp_path / "multi"))),
        cwd=tmp_path, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert cli.main([*job, "--out", str(tmp_path / "single")]) == 0
    losses = {name: [r["loss"] for r in rundir.read_metrics(tmp_path / name / rundir.METRICS_FILE)
                     if "loss" in r] for name in ("multi", "single")}
    assert len(losses["multi"]) == 3
    np.testing.assert_allclose(losses["multi"], losses["single"], rtol=1e-5)

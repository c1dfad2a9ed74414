"""Checkpoints: exact resume in a fresh process, restore onto other meshes and stages, crash
safety, model mismatches, corruption, async saves and keep-last-N.

The run (checkpoint_worker.py): gpt-tiny, ZeRO-3 with hpZ on a 2 x 4 mesh, AdamW, 10 steps;
the checkpoint is taken after step 5.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zeroxla import models
from bitrot import flip_data_bytes
from checkpoint_worker import BATCHES, SAVE_AT, make_run, optimizer, train
from reference import flat_params
from zeroxla import checkpoint
from zeroxla.sharding.config import ZeroConfig
from zeroxla.sharding.mesh import make_mesh
from zeroxla.engine.state import gather_params
from zeroxla.make import make_step

# Compiles many steps: in the full suite, not in the daily `-m "not slow"` subset.
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("checkpoint_worker.py")
RESHARD_TOL = 1e-5


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _params(state):
    return flat_params(gather_params(state))


def _run_worker(*args, timeout=300):
    proc = subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=WORKER.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The uninterrupted run, and a second one checkpointed after SAVE_AT steps."""
    step = make_run()
    state = step.init()
    initial = _host(state)
    _, losses = train(step, state, BATCHES)

    directory = tmp_path_factory.mktemp("checkpoints")
    state, first = train(step, step.init(), BATCHES[:SAVE_AT])
    metadata = {"data_position": SAVE_AT * len(BATCHES[0]["inputs"]),
                "rng": jax.random.key(42)}
    path = checkpoint.save(directory, state, layout=step.layout, metadata=metadata)
    return dict(step=step, losses=losses, initial=initial, directory=directory, path=path,
                state=state, first=first)


def test_resume_in_fresh_process_is_bitwise_exact(run, tmp_path):
    assert run["first"] == run["losses"][:SAVE_AT]
    assert run["path"] == run["directory"] / str(SAVE_AT)
    out = tmp_path / "resumed.json"
    _run_worker("resume", run["directory"], out)
    resumed = json.loads(out.read_text())
    assert resumed["start"] == SAVE_AT
    assert resumed["losses"] == run["losses"][SAVE_AT:]          # bitwise, float32 on CPU
    assert resumed["data_position"] == SAVE_AT * len(BATCHES[0]["inputs"])
    assert resumed["rng"] == jax.random.key_data(jax.random.key(42)).tolist()


def test_restore_in_process_is_identical(run):
    restored = checkpoint.restore(run["directory"], run["step"])
    assert restored.checkpoint_step == SAVE_AT
    assert restored.model_config == models.GPTConfig.tiny()
    assert restored.zero_config == run["step"].layout.config
    same = jax.tree.map(lambda a, b: np.array_equal(a, b), _host(restored.state),
                        _host(run["state"]))
    assert all(jax.tree.leaves(same))


@pytest.mark.parametrize("devices,stage", [(4, 3), (2, 1)])
def test_restore_onto_other_devices_and_stage(run, devices, stage):
    """8 devices ZeRO-3 + hpZ -> 4 devices ZeRO-3 without hpZ, and -> 2 devices ZeRO-1."""
    mesh = make_mesh(1, devices, devices=jax.devices()[:devices])
    config = ZeroConfig(stage=stage, persistence_threshold=500, gradient_clipping=1.0)
    if devices == 4:      # into a step built by the caller
        restored = checkpoint.restore(run["directory"], make_run(mesh, config))
    else:                 # the model rebuilt from the checkpoint's metadata
        restored = checkpoint.restore(run["directory"], (mesh, config), optimizer=optimizer())
    layout = restored.step.layout
    assert layout.plan.data_size == devices and layout.config.stage == stage
    expected = _params(run["state"])
    for path, value in _params(restored.state).items():
        np.testing.assert_array_equal(value, expected[path], err_msg=path)
    _, losses = train(restored.step, restored.state, BATCHES[SAVE_AT:])
    np.testing.assert_allclose(losses, run["losses"][SAVE_AT:], rtol=0, atol=RESHARD_TOL)


@pytest.mark.parametrize("target", ["mesh", "mesh and config"])
def test_restore_onto_a_mesh_without_optimizer_is_refused(run, target):
    """The checkpoint holds AdamW's moments, not the optimizer: a mesh target without
    `optimizer=` is refused by name instead of resuming with make_step's default AdamW(1e-3).
    (With the run's optimizer it resumes: test_restore_onto_other_devices_and_stage.)"""
    mesh = make_mesh(1, 2, devices=jax.devices()[:2])
    arg = mesh if target == "mesh" else (mesh, ZeroConfig(stage=1))
    with pytest.raises(ValueError, match=r"optimizer=None with a mesh target; pass optimizer="):
        checkpoint.restore(run["directory"], arg)


def test_save_takes_the_layout_of_the_step_that_made_the_state(run, tmp_path):
    """`save(layout=)` refuses what is not a layout and the layout of another step (ZeRO-1 on 4
    devices: another plan), naming what to pass, before anything is written; the step itself is
    read as its layout, with a DeprecationWarning (`zeroxla.engine.layout_argument`)."""
    with pytest.raises(TypeError, match=r"save\(layout=\.\.\.\) takes the ZeroLayout of the step "
                                        r"that produced the state \(step\.layout\); got "
                                        r"ShardingPlan"):
        checkpoint.save(tmp_path, run["state"], layout=run["step"].layout.plan)
    other = make_run(make_mesh(1, 4, devices=jax.devices()[:4]), ZeroConfig(stage=1))
    with pytest.raises(ValueError, match=r"save: state is not a TrainState of this layout \(its "
                                         r"plan differs from layout\.plan\)"):
        checkpoint.save(tmp_path, run["state"], layout=other.layout)
    assert not list(tmp_path.iterdir())
    with pytest.warns(DeprecationWarning, match=r"save\(\.\.\., layout=step\) is deprecated; "
                                                r"call save\(\.\.\., layout=step\.layout\)"):
        checkpoint.save(tmp_path / "by_step", run["state"], layout=run["step"])
    restored = checkpoint.restore(tmp_path / "by_step", run["step"])
    assert jax.tree.all(jax.tree.map(np.array_equal, _params(restored.state),
                                     _params(run["state"])))


def test_killed_save_leaves_previous_checkpoint_restorable(run, tmp_path):
    directory, marker = tmp_path / "ck", tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, str(WORKER), "killed-save", directory, marker],
                            cwd=WORKER.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 300
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"worker never reached the second save:\n{proc.communicate()[1][-4000:]}")
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()

    infos = checkpoint.list_checkpoints(directory)
    assert [(c.step, c.complete) for c in infos] == [(0, True), (1, False)]
    assert infos[1].path.name.startswith("1.orbax-checkpoint-tmp")
    assert checkpoint.latest_step(directory) == 0
    with pytest.warns(checkpoint.IncompleteCheckpointWarning,
                      match=r"skipping incomplete checkpoint .*1\.orbax-checkpoint-tmp.*step 1"):
        restored = checkpoint.restore(directory, run["step"])
    assert restored.checkpoint_step == 0
    same = jax.tree.map(lambda a, b: np.array_equal(a, b), _host(restored.state), run["initial"])
    assert all(jax.tree.leaves(same))
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="step 1 .* incomplete"):
        checkpoint.restore(directory, run["step"], step=1)
    # Saving step 1 again replaces the broken temporary directory.
    state = restored.state
    checkpoint.save(directory, state.replace(step=state.step + 1), layout=run["step"].layout)
    assert [(c.step, c.complete) for c in checkpoint.list_checkpoints(directory)] == [
        (0, True), (1, True)]


@pytest.mark.parametrize("model,overrides,path,ours,theirs", [
    ("gpt-tiny", {"d_model": 64}, "blocks/layers/b_proj", (2, 64), (2, 60)),
    ("llama-tiny", {}, "blocks/layers/attn_norm/scale", (2, 60), "absent"),
])
def test_restore_into_other_model_names_first_mismatch(run, model, overrides, path, ours,
                                                       theirs):
    target = make_step(lambda: models.build(model, **overrides), make_mesh(2, 4),
                       optimizer=optimizer(), config=run["step"].layout.config)
    message = (f"first mismatched parameter '{path}': checkpoint shape {theirs}, "
               f"target shape {ours}")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checkpoint.restore(run["directory"], target)


def test_restore_with_other_optimizer_is_refused(run):
    import optax

    target = make_step(lambda: models.build("gpt-tiny", seed=1), make_mesh(2, 4),
                       optimizer=optax.sgd(0.1, momentum=0.9), config=run["step"].layout.config)
    with pytest.raises(ValueError, match="optimizer state leaf .* optimizer the checkpoint"):
        checkpoint.restore(run["directory"], target)


def test_corrupted_array_file_raises(run, tmp_path):
    """Flipped bytes in the data files either fail to decode (tensorstore's zstd check) or decode
    into wrong values that only the per-array checksum catches; which one depends on where a
    flip lands in the files orbax wrote. Either way the restore raises CorruptCheckpointError."""
    directory = tmp_path / "ck"
    shutil.copytree(run["directory"], directory)
    assert flip_data_bytes(directory / str(SAVE_AT) / "state")
    with pytest.raises(checkpoint.CorruptCheckpointError, match="fails its checksum|cannot be read"):
        checkpoint.restore(directory, run["step"])


def test_arrays_that_decode_to_other_values_fail_their_checksum(run, tmp_path):
    """The checksum path, deterministically: the state files of a checkpoint of other values
    (one more training step, same step number and structure) put under this checkpoint's
    metadata decode without error, and the per-array checksums name the first array."""
    step, state = run["step"], run["state"]
    other, _ = train(step, jax.tree.map(jnp.copy, state), BATCHES[SAVE_AT:SAVE_AT + 1])
    other_dir = tmp_path / "other"
    checkpoint.save(other_dir, other.replace(step=state.step), layout=step.layout)
    directory = tmp_path / "ck"
    shutil.copytree(run["directory"], directory)
    shutil.rmtree(directory / str(SAVE_AT) / "state")
    shutil.copytree(other_dir / str(SAVE_AT) / "state", directory / str(SAVE_AT) / "state")
    with pytest.raises(checkpoint.CorruptCheckpointError, match="fails its checksum"):
        checkpoint.restore(directory, step)


def test_corrupted_metadata_raises(run, tmp_path):
    directory = tmp_path / "ck"
    shutil.copytree(run["directory"], directory)
    meta = directory / str(SAVE_AT) / "zeroxla" / "metadata"
    meta.write_text(meta.read_text().replace('"data_position": 40', '"data_position": 41'))
    with pytest.raises(checkpoint.CorruptCheckpointError, match="digest"):
        checkpoint.restore(directory, run["step"])


def test_async_save_keeps_last_n(run, tmp_path):
    state = run["state"]
    with checkpoint.Checkpointer(tmp_path, keep=2, async_save=True) as checkpointer:
        for extra in range(4):
            checkpointer.save(state.replace(step=state.step + extra), layout=run["step"].layout,
                              metadata={"i": extra})
    infos = checkpoint.list_checkpoints(tmp_path)
    assert [(c.step, c.complete) for c in infos] == [(SAVE_AT + 2, True), (SAVE_AT + 3, True)]
    assert checkpoint.read_metadata(tmp_path)["metadata"] == {"i": 3}
    with pytest.raises(checkpoint.CheckpointError, match="only saves steps newer"):
        checkpoint.save(tmp_path, state, layout=run["step"].layout)


def test_loss_scale_round_trip(run, tmp_path):
    """fp16 runs keep their dynamic loss scale; restoring into bf16/fp32 drops it."""
    fp16 = make_run(config=run["step"].layout.config.replace(compute_dtype="float16"))
    restored = checkpoint.restore(run["directory"], fp16)       # saved without a loss scale
    assert float(restored.state.loss_scale.scale) == 2.0 ** 16
    state = restored.state
    state = state.replace(loss_scale=state.loss_scale.replace(
        scale=jax.device_put(jnp.float32(512.0), state.loss_scale.scale.sharding)))
    checkpoint.save(tmp_path, state, layout=fp16.layout)
    again = checkpoint.restore(tmp_path, fp16)
    assert again.loss_scale == 512.0 and float(again.state.loss_scale.scale) == 512.0
    assert checkpoint.restore(tmp_path, run["step"]).state.loss_scale is None


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8"])
def test_frozen_leaves_round_trip(tmp_path, quantized):
    """Frozen leaves (no optimizer state; int8 codes with quantized_nontrainable_weights) save and
    restore onto another mesh exactly (codes: groups cut on the logical tensor, the same on
    both meshes); training continues from the restored state."""
    config = ZeroConfig(stage=3, persistence_threshold=500,
                        quantized_nontrainable_weights=quantized,
                        weight_quantization_group_size=256)
    trainable = nnx.PathContains("w_fc")
    step = make_step(models.build("gpt-tiny"), make_mesh(2, 4), optimizer=optimizer(),
                     config=config, trainable=trainable)
    state = step.init()
    for batch in BATCHES[:2]:
        state, _ = step(state, batch)
    before = _params(state)
    checkpoint.save(tmp_path, state, layout=step.layout)

    other = make_step(models.build("gpt-tiny"), make_mesh(1, 4, devices=jax.devices()[:4]),
                      optimizer=optimizer(), config=config, trainable=trainable)
    restored = checkpoint.restore(tmp_path, other)
    after = _params(restored.state)
    assert after.keys() == before.keys()
    for path, value in before.items():
        np.testing.assert_array_equal(after[path], value, err_msg=path)
    state, metrics = other(restored.state, BATCHES[2])
    assert np.isfinite(float(metrics["loss"]))

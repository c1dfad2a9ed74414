"""ZeRO-Offload (`ZeroConfig.offload_optimizer="cpu"`): the optimizer state and float32 masters
live in host memory, and the step trains exactly as without offload and as single-device optax.

One compiled step per stage (gpt-tiny, 3 steps, gradient accumulation 2, SGD with momentum)
against one shared single-device run; one fp16 pair (offloaded, not offloaded: stage 1, where
the float32 master is a separate partition) with an overflowing step; the placement measured
from the compiled programs of those same steps; a checkpoint round trip through a
non-offloaded mesh; stage 3 under bf16/fp16, where offload keeps a 16-bit partition on the
device; ZeRO++ (slow, with either offload); the refusals (the pipeline's) and the DeepSpeed keys
(no devices). The shared runs and checks are tests/support/offload_cases.py's; parameter offload
is tests/zeroxla/engine/test_param_offload.py's.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroxla
from offload_cases import (BATCH, SEQ, THRESHOLD, assert_same_through_the_overflow,
                           assert_trains_like_single_device, fp16_batches, fp16_run, memory_kinds,
                           poisoned_loss, reference, sgd_run)
from reference import flat_params, token_batches
from runs import run_steps
from zeroxla import checkpoint, models
from zeroxla.analysis.memory import argument_bytes_by_memory_kind
from zeroxla.engine.offload import OffloadError


def _offloaded_run(stage):
    """The offloaded step (stage `stage`, accumulation 2, clipping): step, final state, losses."""
    return sgd_run(stage, offload_optimizer="cpu")


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow),
                                   pytest.param(2, marks=pytest.mark.slow), 3])
def test_offloaded_step_matches_single_device(stage):
    _, state, losses = _offloaded_run(stage)
    assert memory_kinds(state.opt_state) == {"unpinned_host"}          # DeepSpeed's pin_memory=False
    assert_trains_like_single_device(state, losses)


def _fp16_run(offload):
    """Stage 1 under fp16: a float32 master partition beside the 16-bit replicated copy."""
    return fp16_run(1, offload_optimizer=offload)


@pytest.mark.slow   # daily: fp16 overflow skips in test_fp16_loss_scale.py, stage 3 offload here
def test_fp16_offloaded_equals_not_offloaded_and_skips_overflow():
    assert_same_through_the_overflow(_fp16_run("cpu"), _fp16_run("none"))
    state = _fp16_run("cpu")[1]
    masters = [state.params[leaf.path].master for leaf in state.plan.trainable_leaves
               if leaf.has_compute_copy]
    assert masters and memory_kinds(masters) == {"pinned_host"}
    assert memory_kinds(state.opt_state) == {"pinned_host"}


def _split(step, state):
    """Per-device argument bytes of the compiled step by memory kind, and the state's bytes."""
    compiled = step.compile(state, fp16_batches()[0])
    return compiled, argument_bytes_by_memory_kind(compiled)


@pytest.mark.slow
def test_compiled_step_keeps_only_the_parameters_on_the_device():
    """From the compiled programs: offloaded, the host arguments are the optimizer state and the
    float32 masters exactly, and what stays in device memory is the non-offloaded program's
    arguments minus those bytes (the 16-bit copies, the loss scale, the batch)."""
    step, state, _, _ = _fp16_run("cpu")
    compiled, split = _split(step, state)
    report = zeroxla.memory_report(step.compile(state, fp16_batches()[0]), state,
                                   layout=step.layout)
    dev_step, dev_state, _, _ = _fp16_run("none")
    _, dev_split = _split(dev_step, dev_state)

    assert set(dev_split) == {"device"}
    assert report.host_optimizer > 0 and report.optimizer == 0
    assert split["pinned_host"] == report.host_optimizer + report.host_params
    assert split["device"] == dev_split["device"] - split["pinned_host"]
    # XLA's own entry layout puts every pinned_host argument in host memory space S(5).
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", compiled.as_text()).group(1)
    host_args = sum(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(state))
    assert layout.count("S(5)") == host_args
    # estimate_memory, made before anything is allocated, splits the bytes the same way (but
    # for AdamW's int32 step count, not a per-parameter cost).
    estimate = zeroxla.estimate_memory(models.GPTConfig.tiny(), step.layout.mesh,
                                       step.layout.config, optimizer_bytes_per_param=8)
    assert (estimate.params, estimate.optimizer, estimate.host_params) == (
        report.params, 0, report.host_params)
    assert estimate.host_optimizer + 4 == report.host_optimizer
    print(f"\nfp16 stage 1 gpt-tiny per-device arguments: offloaded {split}, "
          f"not offloaded {dev_split}")


def test_stage3_device_state_is_the_parameter_partition():
    step, state, _ = _offloaded_run(3)
    compiled = step.compile(state, reference()[0][0])
    split = argument_bytes_by_memory_kind(compiled)
    report = zeroxla.memory_report(compiled, state, layout=step.layout)
    assert report.optimizer == 0 and report.host_params == 0      # float32: no separate master
    assert split["unpinned_host"] == report.host_optimizer
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves(reference()[0][0])) // 8
    assert split["device"] == report.params + batch_bytes + 4     # + the step counter
    assert "update runs on the host" in step.describe()


@functools.cache
def _stage3_16bit_run(dtype, offload):
    """Stage 3 under `dtype` (bf16 or fp16, with an overflowing step), AdamW, the optimizer
    offloaded or not: step, final state, losses (and overflow flags)."""
    config = zeroxla.ZeroConfig(stage=3, compute_dtype=dtype, persistence_threshold=THRESHOLD,
                                initial_scale_power=10, offload_optimizer=offload)
    step = zeroxla.make_step(models.build("llama-tiny", seed=1), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adamw(3e-3), config=config, loss_fn=poisoned_loss)
    state, metrics = step.init(), []
    batches = fp16_batches() if dtype == "float16" else [
        {**b, "poison": np.ones(BATCH, np.float32)} for b in fp16_batches()]
    for batch in batches:
        state, m = step(state, batch)
        metrics.append((float(m["loss"]), float(m.get("overflow", 0.0))))
    return step, state, metrics


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16",
                                   pytest.param("float16", marks=[pytest.mark.slow,
                                                                  pytest.mark.fusion_emitters])])
def test_stage3_offload_keeps_a_16bit_partition_on_the_device(dtype, tmp_path):
    """Stage 3 with the optimizer offloaded under bf16/fp16 stores each partitioned leaf as
    DeepSpeed's ZeRO-Offload does: its 16-bit partition on the device (what the gathers read),
    the float32 master partition in host memory. The gathered values are the master's 16-bit
    rounding either way, so the losses equal the non-offloaded stage-3 step's bit for bit (fp16:
    through an overflowing step; the fp16 case is a `fusion_emitters` test: with the suite's
    older emitters the two programs' step-3 losses part by one float32 ulp, 3.9123039 against
    3.9123037), and the float32 masters to the last bit but one: the two
    programs store the update's result differently (one array, or master and copy), and XLA
    fuses the AdamW arithmetic differently around it (measured under fp16's overflow select: 2
    of 16 leaves differ by 7.5e-9, one ulp of their largest entries, 0.07; bf16: none). The
    model is llama-tiny: gpt-tiny's key bias has a gradient that is zero in exact arithmetic
    (softmax ignores a shift), so what each program computes for it is rounding noise, which
    AdamW turns into steps of +-lr; two programs compiled differently then part at step 0, and
    the run at the noise level after it (measured on an AVX-512 host: key bias 4e-5 apart
    after one step). The
    device's parameter bytes are the 16-bit partitions plus
    the persistent leaves' copies, as `estimate_memory` predicts; a checkpoint round-trips
    through the non-offloaded layout bit-exactly."""
    step, state, metrics = _stage3_16bit_run(dtype, "cpu")
    _, dev_state, dev_metrics = _stage3_16bit_run(dtype, "none")
    assert metrics == dev_metrics
    if dtype == "float16":
        assert [flag for _, flag in metrics] == [0.0, 1.0, 0.0]
    for a, b in zip(jax.tree.leaves(flat_params(zeroxla.gather_params(state))),
                    jax.tree.leaves(flat_params(zeroxla.gather_params(dev_state)))):
        assert np.abs(a - b).max() <= np.spacing(np.abs(b).max())   # 1 ulp of the leaf's scale
    partitioned = [leaf for leaf in state.plan.trainable_leaves if leaf.params_partitioned]
    assert partitioned
    for leaf in partitioned:
        stored = state.params[leaf.path]
        assert stored.compute.dtype == jnp.dtype(dtype) and stored.master.dtype == jnp.float32
        assert stored.compute.sharding.memory_kind == "device", leaf.path
        assert stored.master.sharding.memory_kind == "unpinned_host", leaf.path
        assert stored.compute.addressable_shards[0].data.shape == stored.master.addressable_shards[
            0].data.shape, leaf.path                 # partitioned alike, 16 bits against 32
    report = zeroxla.memory_report(step.compile(state, fp16_batches()[0]), state,
                                   layout=step.layout)
    estimate = zeroxla.estimate_memory(models.LlamaConfig.tiny(), step.layout.mesh,
                                       step.layout.config)
    assert (report.params, report.host_params, report.optimizer) == (
        estimate.params, estimate.host_params, 0)
    dev_step, dev_state = _stage3_16bit_run(dtype, "none")[:2]
    dev_report = zeroxla.memory_report(dev_step.compile(dev_state, fp16_batches()[0]), dev_state,
                                       layout=dev_step.layout)
    sixteen_bit = sum(2 * leaf.local_layers * leaf.chunk for leaf in partitioned)
    assert report.params < dev_report.params - sixteen_bit        # float32 partitions gone

    mesh = zeroxla.make_mesh(2, 4)
    checkpoint.save(tmp_path / "a", state, layout=step.layout)
    plain = checkpoint.restore(tmp_path / "a", (mesh, step.layout.config.replace(
        offload_optimizer="none")), optimizer=optax.adamw(3e-3))
    checkpoint.save(tmp_path / "b", plain.state, layout=plain.step.layout)
    back = checkpoint.restore(tmp_path / "b", (mesh, step.layout.config),
                              optimizer=optax.adamw(3e-3))
    original = step.layout.logical.to_logical(state)
    for view in (plain.step.layout.logical.to_logical(plain.state),
                 step.layout.logical.to_logical(back.state)):
        for name, value in original.items():
            np.testing.assert_array_equal(view[name], value, err_msg=name)


@pytest.mark.slow   # daily checkpoint round trip: test_train_stop_in_process.py's resume
def test_checkpoint_round_trip_through_a_non_offloaded_mesh(tmp_path):
    """The fp16 stage-1 state (float32 masters, AdamW moments and their count in pinned host
    memory) saved, restored onto the same mesh without offload, saved again and restored with
    offload: every logical array bit-exact, each time in the memory the target asks for."""
    step, state, _, _ = _fp16_run("cpu")
    mesh = zeroxla.make_mesh(2, 4)
    plain = step.layout.config.replace(offload_optimizer="none", offload_pin_memory=False)
    checkpoint.save(tmp_path / "a", state, layout=step.layout)
    restored = checkpoint.restore(tmp_path / "a", (mesh, plain), optimizer=optax.adamw(3e-3))
    assert memory_kinds(restored.state.opt_state) == {"device"}
    checkpoint.save(tmp_path / "b", restored.state, layout=restored.step.layout)
    back = checkpoint.restore(tmp_path / "b", (mesh, step.layout.config),
                              optimizer=optax.adamw(3e-3))
    assert memory_kinds(back.state.opt_state) == {"pinned_host"}
    logical = step.layout.logical.to_logical
    original, plain_view = logical(state), restored.step.layout.logical.to_logical(restored.state)
    back_view = logical(back.state)
    for name, value in original.items():
        np.testing.assert_array_equal(plain_view[name], value, err_msg=name)
        np.testing.assert_array_equal(back_view[name], value, err_msg=name)


# ---- configuration: no devices -----------------------------------------------------------------
@pytest.mark.parametrize("field,value,match", [
    ("offload_optimizer", "nvme", r"offload_optimizer='nvme' is invalid; accepted: 'none' or "
                                  r"'cpu' .*'nvme' is not built"),
    ("offload_param", "gpu", r"offload_param='gpu' is invalid; accepted: 'none' or 'cpu'"),
    ("offload_optimizer", True, r"offload_optimizer=True is invalid; accepted: a string"),
    ("offload_pin_memory", "yes", r"offload_pin_memory='yes' is invalid; accepted: True or False"),
])
def test_config_names_the_offload_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        zeroxla.ZeroConfig(**{field: value})


def test_config_refuses_offload_combinations_by_field():
    with pytest.raises(ValueError, match=r"offload_optimizer='cpu' .*'none' at stage 0"):
        zeroxla.ZeroConfig(stage=0, offload_optimizer="cpu")
    with pytest.raises(ValueError, match=r"offload_param='cpu' .*'none' below stage 3"):
        zeroxla.ZeroConfig(stage=2, offload_param="cpu")
    with pytest.raises(ValueError, match=r"offload_pin_memory=True .*nothing is offloaded"):
        zeroxla.ZeroConfig(offload_pin_memory=True)
    config = zeroxla.ZeroConfig(offload_optimizer="cpu", offload_pin_memory=True)
    assert config.offload_memory_kind == "pinned_host"
    assert zeroxla.ZeroConfig(offload_optimizer="cpu").offload_memory_kind == "unpinned_host"


def test_deepspeed_offload_keys_map_onto_the_config():
    load = zeroxla.zero_config_from_json
    zero = load({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu", "pin_memory": True, "buffer_count": 4}}})
    assert (zero.offload_optimizer, zero.offload_param, zero.offload_pin_memory) == (
        "cpu", "none", True)
    old = load({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert (old.offload_optimizer, old.offload_pin_memory) == ("cpu", False)
    with pytest.raises(ValueError, match=r"zero_optimization.offload_optimizer=.*'nvme' is not "
                                         r"built"):
        load({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})
    with pytest.raises(ValueError, match=r"zero_optimization.offload_optimizer offloads to 'cpu' "
                                         r"at zero_optimization.stage=0"):
        load({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ValueError, match=r"offload_optimizer and zero_optimization.cpu_offload "
                                         r"are both given"):
        load({"zero_optimization": {"stage": 2, "cpu_offload": True,
                                    "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ValueError, match=r"pin_memory=false and .*pin_memory=true differ"):
        load({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "cpu", "pin_memory": True}}})


def test_pipeline_refuses_what_would_change_its_gradient_pass_by_name():
    mesh = zeroxla.make_mesh(1, 4, stages=2)
    pipeline = zeroxla.PipelineConfig(micro_batches=2)
    config = zeroxla.ZeroConfig(stage=3, compute_dtype="bfloat16", offload_optimizer="cpu",
                                persistence_threshold=THRESHOLD)
    with pytest.raises(OffloadError, match=r"offload_optimizer='cpu' at stage 3 under bfloat16 "
                                           r"with pipeline= is not built: .*16-bit copies"):
        zeroxla.make_step(models.build("gpt-tiny"), mesh, config=config, pipeline=pipeline)
    config = zeroxla.ZeroConfig(stage=3, offload_param="cpu")
    with pytest.raises(OffloadError, match=r"offload_param='cpu' with pipeline= is not built"):
        zeroxla.make_step(models.build("gpt-tiny"), mesh, config=config, pipeline=pipeline)
    # Optimizer offload under float32, or at stages 1-2, changes only the shared update.
    for config in (zeroxla.ZeroConfig(stage=3, offload_optimizer="cpu"),
                   zeroxla.ZeroConfig(stage=1, compute_dtype="bfloat16",
                                      offload_optimizer="cpu")):
        zeroxla.make_step(models.build("gpt-tiny"), mesh, config=config, pipeline=pipeline)


@functools.cache
def _zeropp_run(offload_optimizer="none", offload_param="none"):
    """ZeRO++ (hpZ, qwZ, qgZ), 2 AdamW steps: losses and final parameters."""
    config = zeroxla.ZeroConfig(stage=3, persistence_threshold=THRESHOLD, hpz_partition_size=4,
                                quantized_weights=True, quantized_gradients=True,
                                offload_optimizer=offload_optimizer, offload_param=offload_param)
    step = zeroxla.make_step(models.build("gpt-tiny", seed=1), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adamw(3e-3), config=config)
    state, losses = run_steps(step, step.init(), token_batches(2, BATCH, SEQ, vocab=65, seed=7))
    return losses, flat_params(zeroxla.gather_params(state))


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["offload_optimizer", "offload_param"])
def test_zeropp_offloaded_equals_not_offloaded(offload):
    """ZeRO++ with the optimizer offloaded (only the update changes) or the parameters (hpZ's
    secondary partition, qwZ's int8 forward gather and qgZ's int4 reduce-scatter then work on
    the fetched partition): losses and parameters bit-identical to the non-offloaded ZeRO++ run
    (whose own parity is tests/zeroxla/collectives/test_zeropp.py's; measured: 0.0 difference
    after 2 AdamW steps)."""
    losses, params = _zeropp_run(**{offload: "cpu"})
    expected_losses, expected = _zeropp_run()
    assert losses == expected_losses
    for path, value in expected.items():
        np.testing.assert_array_equal(params[path], value, err_msg=path)


@pytest.mark.slow
def test_hybrid_engine_generates_from_an_offloaded_state():
    """The Hybrid Engine reads the float32 masters, which offload keeps in host memory: it
    copies them to the device and generates the tokens of the non-offloaded state."""
    from zeroxla.inference import HybridEngine, HybridEngineConfig

    tokens = {}
    for offload in ("cpu", "none"):
        step, state, _, _ = _fp16_run(offload)
        engine = HybridEngine(step.layout,
                              HybridEngineConfig(inference_tp_size=2, max_out_tokens=12))
        tokens[offload] = engine.generate(state, [np.arange(1, 5, dtype=np.int32)],
                                          max_new_tokens=8, temperature=0.0)[0]
        engine.release()
    np.testing.assert_array_equal(tokens["cpu"], tokens["none"])

"""ZeRO-Infinity's parameter offload (`ZeroConfig(stage=3, offload_param="cpu")`): every
partitioned parameter's partition lives in pinned host memory between steps, is fetched to the
device one unit at a time just before its all-gather, is updated on the host (or, for an optax
transformation JAX cannot trace there, on the device, said by name), and the step trains exactly
as without offload and as single-device optax.

gpt-tiny on the 2x4 mesh, persistence threshold 500 (biases and norms replicated on the device,
matrices partitioned). One float32 run per offload setting (accumulation 2, clipping, SGD with
momentum: 3 steps) against single-device optax; one fp16 pair (offloaded and not) through an
overflowing step; what the compiled program keeps where, from its input shardings and from the
program lowered for a GPU (the update's host computation, and that no partition comes to the
device whole); the device update a transformation the host cannot trace falls back to; a
checkpoint round trip through a non-offloaded mesh.
"""

import re
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from offload_cases import (BATCH, SEQ, THRESHOLD, assert_same_through_the_overflow,
                           assert_trains_like_single_device, fp16_batches, fp16_run, memory_kinds,
                           reference, sgd_run)
from reference import flat_params, token_batches
from runs import run_steps
from zeroxla import checkpoint, models
from zeroxla.analysis.memory import argument_bytes_by_memory_kind
from zeroxla.compat.lowering import lower_for_cuda


def _run(offload_optimizer):
    """Stage 3 with offload_param="cpu" (and the optimizer offloaded or not): step, final state,
    losses."""
    return sgd_run(3, offload_optimizer=offload_optimizer, offload_param="cpu")


def _partitioned(plan):
    return [leaf for leaf in plan.leaves if leaf.params_partitioned]


@pytest.mark.parametrize("offload_optimizer", [
    "none", pytest.param("cpu", marks=pytest.mark.slow)])
def test_parameter_offload_trains_like_single_device(offload_optimizer):
    _, state, losses = _run(offload_optimizer)
    partitioned = {leaf.path for leaf in _partitioned(state.plan)}
    assert partitioned and len(partitioned) < len(state.plan.leaves)
    for path, value in state.params.items():      # pinned whatever offload_pin_memory says
        assert memory_kinds(value) == ({"pinned_host"} if path in partitioned else {"device"}), path
    assert memory_kinds(state.opt_state) == (
        {"unpinned_host"} if offload_optimizer == "cpu" else {"device"})
    assert_trains_like_single_device(state, losses)


def _fp16_run(offload_param):
    """Stage 3 under fp16, parameters offloaded or not."""
    return fp16_run(3, offload_param=offload_param)


@pytest.mark.slow
def test_fp16_parameter_offload_equals_not_offloaded_and_skips_overflow():
    assert_same_through_the_overflow(_fp16_run("cpu"), _fp16_run("none"))
    state = _fp16_run("cpu")[1]
    assert memory_kinds([state.params[leaf.path] for leaf in _partitioned(state.plan)]) == {
        "pinned_host"}


@pytest.mark.slow
def test_compiled_step_keeps_the_partitions_in_host_memory():
    """From the compiled program's input shardings: the host arguments are exactly the
    parameter partitions, and the device keeps the non-offloaded program's arguments less those
    bytes (persistent leaves, optimizer state, loss scale, batch). `memory_report` measures the
    same split on the live state and `estimate_memory` predicts it before anything exists."""
    batch = fp16_batches()[0]
    step, state, _, _ = _fp16_run("cpu")
    dev_step, dev_state, _, _ = _fp16_run("none")
    split = argument_bytes_by_memory_kind(step.compile(state, batch))
    dev_split = argument_bytes_by_memory_kind(dev_step.compile(dev_state, batch))
    partition_bytes = sum(leaf.param_bytes_per_device for leaf in _partitioned(state.plan))
    assert set(dev_split) == {"device"} and set(split) == {"device", "pinned_host"}
    assert split["pinned_host"] == partition_bytes
    assert split["device"] == dev_split["device"] - partition_bytes
    report = zeroxla.memory_report(step.compile(state, batch), state, layout=step.layout)
    dev_report = zeroxla.memory_report(dev_step.compile(dev_state, batch), dev_state,
                                       layout=dev_step.layout)
    assert report.host_params == partition_bytes
    assert report.params == dev_report.params - partition_bytes
    estimate = zeroxla.estimate_memory(models.GPTConfig.tiny(), step.layout.mesh,
                                       step.layout.config)
    assert (estimate.params, estimate.host_params) == (report.params, report.host_params)
    assert "parameter partitions in pinned_host memory" in step.describe()


def _typed_placements(text: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(memory kind, shape, element type) of every `annotate_device_placement` (a
    `jax.device_put` between memory kinds, or a result's memory kind) in a lowered StableHLO
    module."""
    found = re.findall(r'annotate_device_placement.*?_xla_buffer_placement = "(\w+)".*?'
                       r': \(tensor<([0-9x]*?)x?([a-z]+\d*)>', text)
    return [(kind, tuple(int(d) for d in dims.split("x") if d), dtype)
            for kind, dims, dtype in found]


def _placements(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(memory kind, shape) of every `annotate_device_placement` in a lowered module."""
    return [(kind, shape) for kind, shape, _ in _typed_placements(text)]


def _gpu_program(step, state) -> str:
    """The step lowered for a GPU (XLA:CPU ignores memory kinds, so its program cannot show
    where things live)."""
    return lower_for_cuda(step, state, reference()[0][0]).as_text()


def test_the_gpu_program_fetches_one_layer_partition_at_a_time():
    """During the gradient pass a stacked leaf's partition comes to the device one layer at a
    time, in forward and again in backward (the layer loop's fetches, plus the peeled last
    layer's), never the whole stacked partition. The update (SGD with momentum: it traces on
    the host) runs where the partition is: the gradient goes to the host, and of the partition's
    shape only the momentum comes back to the device, where offload_param alone keeps the
    optimizer state (its copy back and the step's output: two placements for each momentum of
    that shape, none for the parameter). So the device holds, of the offloaded parameters, the
    fetched layers (at most two with prefetch, as for the gathered ones), never every layer's
    partition."""
    step, state, _ = _run("none")
    assert step.update_placement.on_host
    placements = _placements(_gpu_program(step, state))
    stacked = [leaf for leaf in _partitioned(state.plan) if leaf.stacked]
    assert stacked
    for leaf in stacked:
        # Inside the gradient pass (shard_map: local shapes): one layer's partition at a time,
        # never the device's whole stacked partition [L, *shard_shape].
        assert placements.count(("device", leaf.shard_shape)) >= 4, leaf.path
        assert placements.count(("device", (leaf.layers, *leaf.shard_shape))) == 0, leaf.path
        # The update, on global arrays, on the host: the gradient in; only the momenta of this
        # shape back (wq, wk and wv share one).
        momenta = sum(other.optimizer_shape == leaf.param_shape
                      for other in state.plan.trainable_leaves)
        assert ("pinned_host", leaf.param_shape) in placements, leaf.path
        assert placements.count(("device", leaf.param_shape)) == 2 * momenta, leaf.path
    per_layer = sum(placements.count(("device", leaf.shard_shape)) for leaf in stacked)
    print(f"\nGPU program: {per_layer} one-layer fetches of {len(stacked)} stacked leaves")


def _host_computation(text: str) -> tuple[list[str], str]:
    """The lowered step's one host computation (a call carrying `_xla_compute_type = "host"`,
    `compute_on("device_host")`): its operands' defining lines, and its function's body with
    the bodies of the functions it calls."""
    main = text.split("func.func private")[0]
    calls = re.findall(r'= call @(\w+)\(([^)]*)\) \{mhlo.frontend_attributes = '
                       r'\{_xla_compute_type = "host"\}\}', main)
    assert len(calls) == 1, [name for name, _ in calls]      # in the step's main function
    name, operands = calls[0]
    definitions = {m.group(1): m.group(0) for m in re.finditer(r'(%[\w#]+) = [^\n]*', main)}
    bodies = dict(re.findall(r'func\.func private @(\w+)\((.*?\n  \})', text, re.S))
    seen, todo = [], [name]
    while todo:
        callee = todo.pop()
        if callee not in seen:
            seen.append(callee)
            todo.extend(re.findall(r'call @(\w+)\(', bodies[callee]))
    return ([definitions.get(op.strip(), op.strip()) for op in operands.split(",")],
            "\n".join(bodies[callee] for callee in seen))


def _adamw_step(compute_dtype, offload_param, optimizer=None):
    config = zeroxla.ZeroConfig(stage=3, persistence_threshold=THRESHOLD,
                                compute_dtype=compute_dtype, offload_optimizer="cpu",
                                offload_param=offload_param)
    step = zeroxla.make_step(models.build("gpt-tiny", seed=1), zeroxla.make_mesh(2, 4),
                             optimizer=optimizer or optax.adamw(3e-3), config=config)
    return step, step.init()


@pytest.mark.parametrize("compute_dtype,offload_param", [
    pytest.param("float32", "cpu", marks=pytest.mark.slow), ("bfloat16", "cpu"),
    ("bfloat16", "none")])
def test_the_gpu_program_updates_on_the_host_and_never_brings_a_partition_in(
        compute_dtype, offload_param):
    """AdamW (it traces on the host) with the optimizer offloaded, and the parameters too
    (ZeRO-Infinity) or not. In the step lowered for a GPU the update is one host computation
    (`compute_on("device_host")`): every operand it reads is placed in pinned host memory first
    (the gradients after their reduction, the masters, partitions and moments where they are),
    every array op in it carries XLA's host compute attribute, and it moves nothing itself. No
    partitioned leaf's float32 partition, whole ([L, *shard] locally or its global shape) or
    stacked, is ever placed on the device: with parameter offload the device's parameters are
    the gradient pass's gathered working set only (one layer's partition at a time); under
    bf16 without it, what comes back is the 16-bit partition the device stores, in 16 bits."""
    step, state = _adamw_step(compute_dtype, offload_param)
    assert step.update_placement.on_host
    assert "update runs on the host (compute_on('device_host')" in step.describe()
    text = _gpu_program(step, state)
    operands, body = _host_computation(text)
    assert operands and all('_xla_buffer_placement = "pinned_host"' in op for op in operands)
    assert "annotate_device_placement" not in body
    for line in body.splitlines():
        op = re.search(r'= (stablehlo\.\w+|call)', line)
        if op and op.group(1) not in ("stablehlo.constant",) and re.search(r'tensor<\d', line):
            assert '_xla_compute_type = "host"' in line, line
    placements = _typed_placements(text)
    partitioned = _partitioned(state.plan)
    for leaf in partitioned:
        on_device = {dtype for kind, shape, dtype in placements if kind == "device"
                     and shape in (leaf.param_shape, (leaf.layers, *leaf.shard_shape))}
        assert on_device == (set() if offload_param == "cpu" else {"bf16"}), leaf.path
        if offload_param == "cpu" and leaf.stacked:
            assert ("device", leaf.shard_shape, "f32" if compute_dtype == "float32" else "bf16"
                    ) in placements, leaf.path              # fetched one layer at a time


@pytest.mark.slow
def test_a_transformation_the_host_cannot_trace_takes_the_device_update_and_says_so():
    """`optax.clip_by_global_norm` does not trace under `compute_on("device_host")` on JAX 0.10
    nor 0.12 (a device-typed temporary meets the host-typed gradients): `make_step` warns and the
    step runs the update on the device between explicit copies, `describe()` naming the
    transformation; the GPU program then brings the partitions in for the update. It trains
    bit-identically to the step without offload (2 steps: losses and parameters)."""
    def chained():
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))
    with pytest.warns(UserWarning, match=r"runs on the device with explicit transfers, not on "
                                         r"the host: optax\.clip_by_global_norm does not trace"):
        step, state = _adamw_step("float32", "cpu", chained())
    assert not step.update_placement.on_host
    assert ("update runs on device (explicit host<->device transfers around the update: "
            "optax.clip_by_global_norm does not trace under compute_on('device_host')"
            ) in step.describe()
    assert "_xla_compute_type" not in (text := _gpu_program(step, state))
    stacked = [leaf for leaf in _partitioned(state.plan) if leaf.stacked]
    assert all(("device", leaf.param_shape) in _placements(text) for leaf in stacked)
    plain = zeroxla.make_step(models.build("gpt-tiny", seed=1), zeroxla.make_mesh(2, 4),
                              optimizer=chained(), config=zeroxla.ZeroConfig(
                                  stage=3, persistence_threshold=THRESHOLD))
    batches = token_batches(2, BATCH, SEQ, vocab=65, seed=4)
    runs = [run_steps(s, s.init(), batches) for s in (step, plain)]
    assert runs[0][1] == runs[1][1]
    for a, b in zip(jax.tree.leaves(flat_params(zeroxla.gather_params(runs[0][0]))),
                    jax.tree.leaves(flat_params(zeroxla.gather_params(runs[1][0])))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("optimizer,refused_by", [
    (optax.sgd(0.1, momentum=0.9), None), (optax.adamw(1e-3), None), (optax.lion(1e-4), None),
    (optax.lamb(1e-3), "optax.scale_by_trust_ratio"), (optax.adafactor(1e-3), "optax.scale_by_"),
])
def test_the_update_placement_names_what_cannot_run_on_the_host(optimizer, refused_by):
    """Which transformations JAX (0.10 and 0.12 alike) traces under host compute (elementwise
    ones), and the one named when it does not (LAMB's trust ratio, Adafactor's block RMS)."""
    config = zeroxla.ZeroConfig(stage=3, persistence_threshold=THRESHOLD, offload_param="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = zeroxla.make_step(models.build("gpt-tiny", seed=1), zeroxla.make_mesh(2, 4),
                                 optimizer=optimizer, config=config)
    placement = step.update_placement
    assert placement.on_host == (refused_by is None)
    if refused_by is not None:
        assert placement.refused_by.startswith(refused_by)
        assert "memory_space of all inputs passed to" in placement.refused_by
        assert any(refused_by in str(w.message) for w in caught)


@pytest.mark.slow
def test_checkpoint_round_trip_through_a_non_offloaded_mesh(tmp_path):
    """The fp16 stage-3 state with its partitions in pinned host memory saved, restored onto the
    same mesh without offload, saved again and restored with offload: every logical array
    bit-exact, each time in the memory the target asks for."""
    step, state, _, _ = _fp16_run("cpu")
    mesh = zeroxla.make_mesh(2, 4)
    paths = [leaf.path for leaf in _partitioned(state.plan)]
    checkpoint.save(tmp_path / "a", state, layout=step.layout)
    restored = checkpoint.restore(tmp_path / "a",
                                  (mesh, step.layout.config.replace(offload_param="none")),
                                  optimizer=optax.adamw(3e-3))
    assert memory_kinds([restored.state.params[p] for p in paths]) == {"device"}
    checkpoint.save(tmp_path / "b", restored.state, layout=restored.step.layout)
    back = checkpoint.restore(tmp_path / "b", (mesh, step.layout.config),
                              optimizer=optax.adamw(3e-3))
    assert memory_kinds([back.state.params[p] for p in paths]) == {"pinned_host"}
    logical = step.layout.logical.to_logical
    original, plain_view = logical(state), restored.step.layout.logical.to_logical(restored.state)
    back_view = logical(back.state)
    for name, value in original.items():
        np.testing.assert_array_equal(plain_view[name], value, err_msg=name)
        np.testing.assert_array_equal(back_view[name], value, err_msg=name)


@pytest.mark.parametrize("quantized_frozen", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_frozen_partitions_are_offloaded_and_train_as_without(quantized_frozen):
    """Frozen leaves (everything but the MLP's first matrix) are partitions too: offloaded with
    the trainable ones (as float32, or as ZeRO++'s stored int8 codes), fetched the same way, and
    given no gradient; 2 AdamW steps equal the non-offloaded run's bit for bit."""
    batches = token_batches(2, BATCH, SEQ, vocab=65, seed=4)
    runs = {}
    for offload in ("none", "cpu"):
        config = zeroxla.ZeroConfig(stage=3, persistence_threshold=THRESHOLD,
                                    quantized_nontrainable_weights=quantized_frozen,
                                    offload_param=offload)
        step = zeroxla.make_step(models.build("gpt-tiny", seed=1), zeroxla.make_mesh(2, 4),
                                 optimizer=optax.adamw(3e-3), config=config,
                                 trainable=nnx.PathContains("w_fc"))
        state, losses = run_steps(step, step.init(), batches)
        runs[offload] = (losses, jax.tree.map(np.asarray, state.params))
        frozen = [state.params[leaf.path] for leaf in _partitioned(state.plan)
                  if not leaf.trainable]
        assert frozen and memory_kinds(frozen) == ({"pinned_host"} if offload == "cpu" else {"device"})
    assert runs["cpu"][0] == runs["none"][0]
    for a, b in zip(jax.tree.leaves(runs["cpu"][1]), jax.tree.leaves(runs["none"][1])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_parameter_offload_with_recompute_jit_gathers_and_16bit_partitions():
    """Other paths through the fetch: remat "full" (backward re-runs each layer from its input,
    fetching again), no prefetch (each layer fetched and gathered just before it runs), and bf16
    with the optimizer offloaded (the partitions fetched are 16-bit, their float32 masters in
    host memory too): 2 AdamW steps bit-identical to the same run without parameter offload
    (measured: 0.0 difference)."""
    runs = []
    for offload in ("none", "cpu"):
        config = zeroxla.ZeroConfig(stage=3, persistence_threshold=THRESHOLD, remat="full",
                                    prefetch=False, compute_dtype="bfloat16",
                                    offload_optimizer="cpu", offload_param=offload)
        step = zeroxla.make_step(models.build("gpt-tiny", seed=1), zeroxla.make_mesh(2, 4),
                                 optimizer=optax.adamw(3e-3), config=config)
        state, losses = run_steps(step, step.init(), token_batches(2, BATCH, SEQ, vocab=65, seed=3))
        runs.append((losses, jax.tree.map(np.asarray, zeroxla.gather_params(state))))
        copies = [state.params[leaf.path].compute for leaf in _partitioned(state.plan)]
        assert memory_kinds(copies) == ({"pinned_host"} if offload == "cpu" else {"device"})
    assert runs[0][0] == runs[1][0]
    for a, b in zip(jax.tree.leaves(runs[0][1]), jax.tree.leaves(runs[1][1])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["offload_param", "offload_optimizer"])
def test_hybrid_engine_generates_from_offloaded_partitions(offload):
    """The Hybrid Engine reads the partitions where offload keeps them: in pinned host memory
    (parameter offload), or, with the optimizer offloaded, as 16-bit device partitions beside
    float32 masters in host memory (`MasterWithCopy`). Either way it generates the
    non-offloaded state's tokens (stage 3, fp16)."""
    from zeroxla.inference import HybridEngine, HybridEngineConfig

    tokens = []
    for run in (fp16_run(3, **{offload: "cpu"}), _fp16_run("none")):
        step, state, _, _ = run
        engine = HybridEngine(step.layout,
                              HybridEngineConfig(inference_tp_size=2, max_out_tokens=12))
        tokens.append(engine.generate(state, [np.arange(1, 5, dtype=np.int32)],
                                      max_new_tokens=8, temperature=0.0)[0])
        engine.release()
    np.testing.assert_array_equal(tokens[0], tokens[1])


@pytest.mark.slow
def test_a_tiled_block_reading_offloaded_partitions_trains_like_single_device():
    """Llama with `mlp_chunk` (its norms, projections and MLP chunk by chunk under one custom
    VJP, `models.tiled_mlp`, the final norm's weight read through the ZeRO-3 head's gathered
    call): the offloaded partitions the chunks close over get their cotangents in host memory
    (this failed at trace time before), and one SGD step equals single-device optax."""
    from zeroxla.models import Llama, LlamaConfig
    from reference import train_single_device

    def build():
        return Llama(LlamaConfig(d_model=64, num_heads=8, num_kv_heads=2, mlp_chunk=4),
                     rngs=nnx.Rngs(0))
    batch = token_batches(1, 8, 16, vocab=65, seed=4)[0]
    initial = flat_params(nnx.state(build(), nnx.Param))
    _, want = train_single_device(build(), optax.sgd(1.0), [batch])
    step = zeroxla.make_step(build, zeroxla.make_mesh(2, 4), optimizer=optax.sgd(1.0),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0,
                                                       offload_param="cpu"))
    state, _ = step(step.init(), batch)
    got = flat_params(nnx.state(step.gathered_model(state), nnx.Param))
    scale = max(float(np.max(np.abs(want[p] - initial[p]))) for p in want)
    worst = max(float(np.max(np.abs(got[p] - want[p]))) for p in want)
    assert worst <= 5e-6 * scale, (worst, scale)     # float32 reduction order (8 devices)

"""ZeRO-3's traffic, read from the compiled step: 2x parameters gathered, 1x reduce-scattered."""

import functools

import numpy as np
import optax
import pytest
from flax import nnx

from zeroxla import models
import zeroxla
from runs import run_steps
from reference import distance_over_travelled, flat_params, token_batches, train_single_device
from tracking import travel_ratio
from zeroxla.analysis.comm_report import comm_report

# Compiles many steps: in the full suite, not in the daily `-m "not slow"` subset.
pytestmark = pytest.mark.slow


def _config_report(model_name, num_layers, config):
    """(step, `comm_report`) of `model_name`'s SGD step on 2 x 4 devices under `config`."""
    model = models.build(model_name, num_layers=num_layers)
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.1),
                             config=config)
    state = step.init()
    batch = token_batches(1, 16, 16, vocab=65)[0]
    return step, comm_report(step, state, batch)


@pytest.fixture(scope="module")
def reports():
    """`report(model_name, stage, threshold=500, num_layers=2, **config)`: `_config_report`
    under that ZeroConfig, each program compiled once per test file (the float32 step every
    16-bit comparison and the stage 0 and 2 checks read is one program per stage)."""
    cached = functools.cache(_config_report)

    def report(model_name, stage, threshold=500, num_layers=2, **config):
        return cached(model_name, num_layers, zeroxla.ZeroConfig(
            stage=stage, persistence_threshold=threshold, **config))
    return report


def _partitioned_bytes(step):
    """float32 bytes of every partitioned parameter, padding included (what is gathered)."""
    return sum(4 * leaf.layers * leaf.padded_numel for leaf in step.layout.plan.leaves
               if leaf.params_partitioned)


THRESHOLD = 500
# Top-level partitioned leaves that backward gathers again: only a weight whose backward needs
# it (a matmul's input gradient). gpt's tied embedding serves the head, so it is re-gathered;
# a lookup table (gpt's wpe, llama's embed) needs no weight for its gradient; llama's head
# weight, gathered last in forward, is used by its backward from that same gather (XLA merges
# the two adjacent gathers of one operand).
REGATHERED = {"gpt-tiny": {"embed/wte"}, "llama-tiny": set()}
# A tied leaf's gradient is reduce-scattered at each use ("gathered at each use, gradients
# summed over the uses", `ShardingPlan.describe`): gpt's wte twice (embedding and head).
USES = {"gpt-tiny": {"embed/wte": 2}, "llama-tiny": {}}


def _stored_bytes(model_name, step):
    """float32 bytes computed here from the model's shapes, the split dim (the plan's choice)
    zero-padded to a multiple of the 8 devices: ({path: (padded bytes, stacked)} of the
    partitioned leaves (a unit, one layer of a stacked leaf, of at least THRESHOLD elements),
    bytes of the replicated leaves, and those padded (their optimizer state is split))."""
    model = models.build(model_name, num_layers=2)
    partitioned, replicated, replicated_padded = {}, 0, 0
    for path, value in flat_params(nnx.state(model, nnx.Param)).items():
        leaf = step.layout.plan[path]
        padded = list(value.shape)
        padded[leaf.shard_dim] = -(-padded[leaf.shard_dim] // 8) * 8
        stacked = path.startswith("blocks/")
        unit = value.shape[1:] if stacked else value.shape
        if int(np.prod(unit)) < THRESHOLD:
            assert not leaf.params_partitioned and leaf.optimizer_partitioned, path
            replicated += 4 * value.size
            replicated_padded += 4 * int(np.prod(padded))
        else:
            assert leaf.params_partitioned, path
            partitioned[path] = (4 * int(np.prod(padded)), stacked)
    return partitioned, replicated, replicated_padded


@pytest.mark.parametrize("model_name", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_stage3_gathers_twice_and_scatters_once(model_name, prefetch, reports):
    """Exact bytes, from the shapes: forward gathers every partitioned leaf once (each layer of
    a stacked one); backward gathers every layer again, and of the top-level leaves those in
    REGATHERED; gradients are reduce-scattered once per use; the replicated leaves' gradients
    are all-reduced once, beside float32 scalars, 4 bytes per leaf and 8 more (measured: the
    loss sum and token count, and per-leaf sums for the gradient norm, as XLA combines them);
    the replicated leaves' optimizer partitions are gathered back after the update."""
    step, report = reports(model_name, 3, threshold=THRESHOLD, prefetch=prefetch)
    partitioned, replicated, replicated_padded = _stored_bytes(model_name, step)
    total = sum(b for b, _ in partitioned.values())
    stacked = sum(b for b, is_stacked in partitioned.values() if is_stacked)
    regathered = sum(partitioned[p][0] for p in REGATHERED[model_name])
    reused = sum((uses - 1) * partitioned[p][0] for p, uses in USES[model_name].items())
    assert report.all_gather_bytes("zero_fwd_gather") == total
    assert report.all_gather_bytes("zero_bwd_gather") == stacked + regathered
    assert report.reduce_scatter_bytes() == total + reused
    assert report.all_reduce_bytes() == replicated + 4 * (len(step.layout.plan.leaves) + 2)
    # and no other gather: after the optimizer only the replicated leaves' updated partitions
    assert report.all_gather_bytes("zero_param_update") == replicated_padded
    assert report.all_gather_bytes() == total + stacked + regathered + replicated_padded


def test_stage3_gathers_inside_the_layer_loop(reports):
    _, report = reports("llama-tiny", 3, num_layers=4)   # a 2-layer scan is unrolled by XLA
    looped = [c for c in report.collectives if c.kind == "all-gather" and c.multiplier > 1]
    assert looped, "stage 3 should gather layers inside the scan"


def test_stage2_has_no_parameter_gather_in_the_layer_loop(reports):
    step, report = reports("gpt-tiny", 2)
    looped = [c for c in report.collectives if c.kind == "all-gather" and c.multiplier > 1]
    assert looped == []
    # Stage 2 gathers only the updated parameters, once, after the optimizer.
    assert report.all_gather_bytes() == report.all_gather_bytes("zero_param_update")
    # Gradients are reduce-scattered per unit in backward, inside the layer loop; a weight used
    # by two module calls (gpt's tied embedding: embed and head) once, after both uses.
    assert [c for c in report.collectives if c.kind == "reduce-scatter" and c.multiplier > 1]
    assert report.reduce_scatter_bytes() == pytest.approx(
        sum(4 * leaf.layers * leaf.padded_numel for leaf in step.layout.plan.trainable_leaves
            if leaf.optimizer_partitioned), rel=0.01)


def test_stage0_all_reduces_everything_once(reports):
    step, report = reports("gpt-tiny", 0)
    assert report.all_gather_bytes() == 0 and report.reduce_scatter_bytes() == 0
    total = sum(4 * leaf.numel for leaf in step.layout.plan.leaves)
    assert report.all_reduce_bytes() == pytest.approx(total, rel=0.01, abs=64)


def test_bf16_compute_communicates_bf16(reports):
    """bf16 compute moves bf16 on the wire: gathers as raw 16-bit words, and the gradient
    reduction as a 16-bit all-to-all summed in float32 by the receiver (see collectives.py)."""
    step, report = reports("llama-tiny", 3, compute_dtype="bfloat16")
    param_bytes = _partitioned_bytes(step)
    gathers = [c for c in report.collectives if c.kind == "all-gather"
               and "zero_param_update" not in c.op_name]      # not the fp32 master update
    assert gathers and {c.results[0].dtype for c in gathers} == {"u16"}
    assert sum(c.payload_bytes * c.multiplier for c in gathers) == pytest.approx(
        param_bytes, rel=0.10)                                 # 2x at half the size
    reductions = [c for c in report.collectives if c.kind == "all-to-all"]
    assert {c.operands[0].dtype for c in reductions} == {"u16"}
    assert report.all_to_all_bytes() == pytest.approx(param_bytes / 2, rel=0.10)
    assert report.reduce_scatter_bytes() == 0


def _temporaries(num_layers, remat):
    model = models.GPT(models.GPTConfig(d_model=256, num_heads=4, num_layers=num_layers,
                                        mlp_dim=1024, max_seq_len=16), rngs=nnx.Rngs(0))
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.1),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=1000,
                                                       remat=remat))
    state = step.init()
    batch = token_batches(1, 8, 8, vocab=65)[0]
    report = zeroxla.memory_report(step.compile(state, batch), state, layout=step.layout)
    layer_bytes = 4 * sum(leaf.unit_numel for leaf in step.layout.plan.leaves if leaf.stacked)
    return report.temporaries, layer_bytes


@pytest.mark.parametrize("remat", ["none", "full"])
def test_never_the_whole_model_live(remat):
    """Parameters dominate here (wide layers, a tiny batch). Each extra layer may add its
    partitioned share (gradient buffers, 1/8 of a layer each) and, with remat "none", its
    activations, never a gathered layer: the step's temporaries grow by well under half a layer
    per layer, and the rest is about two layers (the one computing and the one being
    prefetched)."""
    small, layer_bytes = _temporaries(4, remat)
    large, _ = _temporaries(8, remat)
    per_layer = (large - small) / 4
    assert per_layer < 0.5 * layer_bytes
    assert small - 4 * per_layer < 3 * layer_bytes


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_16bit_stages_0_to_2_send_half_the_float32_bytes(stage, dtype, reports):
    """Under bf16/fp16 the gradient reduction (stage 0-1 all-reduce, stage 2 per-unit
    reduce-scatter) and, at stages 1-2, the all-gather of the updated parameters (the 16-bit
    rounding of the float32 master partition, into the 16-bit compute copy) travel in 16 bits.
    Sent bytes per device, whole step (`comm_report`), measured on gpt-tiny: 0.50007 / 0.50011 /
    0.50011 of float32 (bf16; fp16 0.50007 / 0.50025 / 0.50030). Stages 0-2 are 0.5 up to the
    scalar loss terms and the flat all-reduce's padding to a multiple of 8; the parameter
    gather after the optimizer is exactly 0.5. Stage 2 reduces the tied embedding's gradient
    once, after both its uses (`engine.gradients.reduced_once`), as the float32 program does."""
    phases, total = {}, {}
    for name in ("float32", dtype):
        _, report = reports("gpt-tiny", stage, compute_dtype=name)
        phases[name] = {p: report.traffic(phase=p).total
                        for p in ("zero_grad_reduce", "zero_param_update")}
        total[name] = report.total_bytes
    assert phases[dtype]["zero_param_update"] == 0.5 * phases["float32"]["zero_param_update"]
    assert total[dtype] == pytest.approx(0.5 * total["float32"], rel=1e-3)
    if stage > 0:
        assert phases[dtype]["zero_param_update"] > 0


@functools.cache
def _float32_single_device():
    """(batches, losses, final params, initial params) of plain float32 SGD on one device."""
    batches = token_batches(3, 16, 16, vocab=65, seed=4)
    losses, params = train_single_device(models.build("gpt-tiny", seed=1), optax.sgd(0.5),
                                         batches)
    initial = flat_params(nnx.state(models.build("gpt-tiny", seed=1), nnx.Param))
    return batches, losses, params, initial


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_tracks_float32_single_device(stage):
    """bf16 compute with gradients reduced in bf16 (summed in float32 by the receiver on CPU)
    and, at stages 1-2, the float32 master partitions gathered as a bf16 copy, against plain
    float32 optax on one device (SGD: Adam would normalise a wrong gradient scale away).
    Measured, stages 0-2: losses within 1.3e-4, the parameters' distance from the reference
    0.60% of the distance travelled, the travel ratio 1 within 1.5e-4; with every 16-bit
    reduced gradient scaled by 1.01: losses 4.3e-4, distance 0.98-1.0%, ratio 1.0054-1.0055.
    bf16's rounding noise alone is half that distance, so the ratio is the sharp check
    (`tracking.py`)."""
    batches, expected_losses, expected, initial = _float32_single_device()
    step = zeroxla.make_step(models.build("gpt-tiny", seed=1), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.5),
                             config=zeroxla.ZeroConfig(stage=stage, compute_dtype="bfloat16"))
    state, losses = run_steps(step, step.init(), batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=5e-4)
    got = flat_params(zeroxla.gather_params(state))
    assert distance_over_travelled(got, expected, initial) < 0.01
    assert abs(travel_ratio(got, expected, initial) - 1) < 1e-3

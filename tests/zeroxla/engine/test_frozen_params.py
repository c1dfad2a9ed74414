"""Frozen parameters (`make_step(..., trainable=)`) and ZeRO++'s quantized_nontrainable_weights.

The model is LoRA-style: frozen embedding, base projections and head, trainable low-rank A/B
adapters (`nnx.LoRAParam`). Every frozen matrix's partition on the 8 devices is a whole number
of quantization groups (groups are cut within rows, `zeroxla.sharding.plan.frozen_code_groups`:
here rows of 64, 256 or 512 elements), which makes the storage and traffic arithmetic exact.
Frozen training is compared with single-device optax where the frozen leaves are masked
(`optax.multi_transform` with `set_to_zero`; the trainable leaves chosen by nnx's own filter,
not by the engine): float32 storage against the initial weights, int8 and int4 codes against
the weights dequantized here in float64 numpy from the codes and steps the step stored (code *
step per group, int4 codes sign-extended from their nibbles), so a quantized run is held to the
same rtol 1e-5 as a float one.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zeroxla import models
import zeroxla
from zeroxla.pallas_kernels import quantize
from reference import flat_params, masked_optimizer, token_batches, train_single_device
from runs import device_bytes
from zeroxla.analysis.comm_report import comm_report, phase_of
from zeroxla.sharding.mesh import MeshAxes
from zeroxla.sharding.plan import make_plan
from zeroxla.engine.step import frozen_paths
from zeroxla.engine.stored import dequantize_partitioned, logical_to_storage, storage_to_logical
from zeroxla.sharding.stored_forms import StoredCodes

VOCAB, D, HIDDEN, RANK = 64, 256, 512, 8
STEPS, BATCH, SEQ = 5, 16, 8
THRESHOLD = 3000  # up/lora_a [256, 8] stays replicated, up/lora_b [8, 512] is partitioned
FROZEN = ("embed/table", "up/base", "up/bias", "down/base", "down/bias", "head/w")
QUANTIZED = ("embed/table", "up/base", "down/base", "head/w")   # frozen and partitioned
TRAINABLE = ("up/lora_a", "up/lora_b", "down/lora_a", "down/lora_b")


class LoRALinear(nnx.Module):
    """x @ base + bias + (x @ lora_a) @ lora_b; base and bias frozen, the adapters trained."""

    def __init__(self, din: int, dout: int, rank: int, rngs: nnx.Rngs):
        init = nnx.initializers.normal(din ** -0.5)
        self.base = nnx.Param(init(rngs.params(), (din, dout)), logical_axes=("embed", "mlp"))
        self.bias = nnx.Param(jnp.zeros((dout,)), logical_axes=("mlp",))
        # B starts small but nonzero, so A gets a gradient from the first step.
        self.lora_a = nnx.LoRAParam(init(rngs.params(), (din, rank)),
                                    logical_axes=("embed", "rank"))
        self.lora_b = nnx.LoRAParam(0.1 * init(rngs.params(), (rank, dout)),
                                    logical_axes=("rank", "mlp"))

    def __call__(self, x: jax.Array) -> jax.Array:                      # [B, T, din]
        return x @ self.base + self.bias + (x @ self.lora_a) @ self.lora_b  # [B, T, dout]


class Embedding(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.table = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (VOCAB, D)),
                               logical_axes=("vocab", "embed"))

    def __call__(self, tokens: jax.Array) -> jax.Array:                # [B, T] -> [B, T, D]
        return self.table[tokens]


class Head(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(nnx.initializers.normal(D ** -0.5)(rngs.params(), (D, VOCAB)),
                           logical_axes=("embed", "vocab"))

    def __call__(self, x: jax.Array) -> jax.Array:                     # [B, T, D] -> [B, T, V]
        return x @ self.w


class LoRAMLP(nnx.Module):
    """Each module owns its parameters, so ZeRO-3 gathers them per module call."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = Embedding(rngs)
        self.up = LoRALinear(D, HIDDEN, RANK, rngs)
        self.down = LoRALinear(HIDDEN, D, RANK, rngs)
        self.head = Head(rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:                # [B, T] -> [B, T, V]
        x = self.embed(tokens)
        x = x + self.down(jax.nn.gelu(self.up(x)))
        return self.head(x)


def _lora_model():
    return LoRAMLP(nnx.Rngs(0))


def _batches(model_name="lora"):
    return token_batches(STEPS, BATCH, SEQ, vocab=VOCAB if model_name == "lora" else 65)


def _optimizer():
    # eps 1e-4, not 1e-8: with eps far below a gradient's rounding noise, Adam's normalised step
    # turns a 1e-9 difference in a near-zero gradient into a 1e-5 difference in the parameter.
    return optax.adamw(1e-2, eps=1e-4, weight_decay=0.1)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _model_and_filter(model_name, trainable_name):
    if model_name == "lora":
        return _lora_model(), {"lora_param": nnx.LoRAParam,
                               "lora_b": nnx.PathContains("lora_b")}[trainable_name]
    # The tiny GPT with everything but the MLP's first matrix frozen.
    return models.build("gpt-tiny", seed=1), nnx.PathContains(trainable_name)


def _train(model_name, trainable_name, **config):
    """5 steps of the ZeRO step; (step, final state, stored params at init (host), losses)."""
    model, trainable = _model_and_filter(model_name, trainable_name)
    config = zeroxla.ZeroConfig(**{"stage": 3, "persistence_threshold": THRESHOLD, **config})
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=_optimizer(),
                             config=config, trainable=trainable)
    state = step.init()
    initial = _host(state.params)
    losses = []
    for batch in _batches(model_name):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return step, state, initial, losses


@functools.cache
def _reference(model_name, trainable_name, bits=0):
    """Single-device optax with the frozen leaves masked: (losses, final params). With `bits`,
    the frozen leaves stored as codes start from `_dequantized_codes` of that run's storage."""
    model, trainable = _model_and_filter(model_name, trainable_name)
    trained = set(flat_params(nnx.state(model, trainable)))     # nnx decides, not the engine
    if bits:
        step, _, stored_before, _ = _frozen_run(bits)
        for leaf in _quantized_leaves(step):
            _set_param(model, leaf.path, _dequantized_codes(leaf, stored_before[leaf.path]))

    return train_single_device(model, masked_optimizer(_optimizer(), trained),
                               _batches(model_name))


def _set_param(model, path, value):
    *parents, name = path.split("/")
    for parent in parents:
        model = getattr(model, parent)
    getattr(model, name)[...] = jnp.asarray(value, jnp.float32)


def _dequantized_codes(leaf, stored):
    """float64 numpy, written from the format (`StoredCodes`): a frozen leaf's logical values
    from its stored codes. Device d's rows hold the groups of its partition d (the padded leaf
    split into 8 equal blocks along the shard dim, flattened); a group's values are code * step;
    int4 bytes hold code k in the low nibble and code k + group/2 in the high one, both signed."""
    data = np.asarray(stored.data).astype(np.int64)                    # [8 * G, packed]
    steps = np.asarray(stored.scales, np.float64)                      # [8 * G]
    if leaf.storage_bits == 4:
        low = ((data & 0xF) ^ 8) - 8                                   # sign-extend 4 bits
        codes = np.concatenate([low, data >> 4], axis=-1)              # int8 >> 4 is signed
    else:
        codes = data
    values = (codes * steps[:, None]).reshape(8, -1)                   # [8, G * group]
    shape, dim = leaf.shape, leaf.shard_dim
    block = list(shape)
    block[dim] = -(-shape[dim] // 8)                                   # ceil: zero padding
    size = int(np.prod(block))
    padded = np.concatenate([values[d, :size].reshape(block) for d in range(8)], axis=dim)
    return np.take(padded, np.arange(shape[dim]), axis=dim)


@functools.cache
def _frozen_run(bits):
    """The LoRA model trained with float32 (bits 0) or int8 / int4 frozen storage (shared by
    tests)."""
    if not bits:
        return _train("lora", "lora_param")
    return _train("lora", "lora_param", quantized_nontrainable_weights=True,
                  weight_quantization_bits=bits)


# ---------------------------------------------------------------------------------------------
# Which leaves are frozen, and what a frozen leaf has.

def test_filters_choose_the_trainable_leaves():
    model = _lora_model()
    everything = set(flat_params(nnx.state(model, nnx.Param)))
    assert frozen_paths(model, None) == frozenset()
    assert frozen_paths(model, nnx.LoRAParam) == set(FROZEN)
    assert frozen_paths(model, nnx.Not(nnx.LoRAParam)) == set(TRAINABLE)
    assert frozen_paths(model, nnx.PathContains("lora_a")) == everything - {"up/lora_a",
                                                                           "down/lora_a"}
    assert frozen_paths(model, lambda path, _: path[0] == "head") == everything - {"head/w"}
    with pytest.raises(ValueError, match="selects none"):
        zeroxla.make_step(model, zeroxla.make_mesh(2, 4), trainable=nnx.PathContains("nope"))


def test_frozen_leaves_have_no_optimizer_state_and_show_in_the_plan():
    step = zeroxla.make_step(_lora_model(), zeroxla.make_mesh(2, 4), optimizer=optax.adam(1e-3),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=THRESHOLD),
                             trainable=nnx.LoRAParam)
    plan = step.layout.plan
    assert {leaf.path for leaf in plan.trainable_leaves} == set(TRAINABLE)
    assert not plan["up/base"].trainable and plan["up/base"].params_partitioned
    assert not plan["up/base"].optimizer_partitioned                 # there is no state to split
    assert plan["up/lora_a"].persistent and plan["up/lora_b"].params_partitioned
    state = step.init()
    moments = optax.tree_utils.tree_get(state.opt_state, "mu")   # the model's tree, as in optax
    assert set(flat_params(moments)) == set(TRAINABLE)
    table = plan.describe()
    assert "partitioned dim 0, frozen" in table and "under persistence threshold, frozen" in table
    rows = {row[0]: row for row in step.describe_collectives()}
    assert rows["up/base"][3] == "none (frozen)"
    assert rows["up/lora_b"][3].startswith("reduce-scatter")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape,axes", [((65, 60), ("vocab", "embed")),
                                        ((3, 7, 6), ("layers", "embed", "mlp"))])
def test_plan_quantized_storage_round_trip(shape, axes, bits):
    """Pure layout logic: a frozen leaf's codes come back (padding and all) within one
    quantization step, in the storage shapes and specs the plan states."""
    plan = make_plan({"w": shape, "b": (4,)}, {"w": axes}, stage=3,
                     axes=MeshAxes(("node", "local"), (2, 4)),
                     persistence_threshold=5, frozen={"w", "b"}, frozen_storage_bits=bits,
                     frozen_group_size=256)
    leaf, bias = plan["w"], plan["b"]
    assert leaf.params_quantized and not leaf.trainable and not leaf.optimizer_partitioned
    assert not bias.params_quantized and bias.persistent          # frozen but replicated: float
    assert plan.trainable_leaves == ()
    # Groups are cut on the logical tensor, within a row (the dims after the shard dim): here
    # rows shorter than 256 are one group each, and every shard holds whole rows.
    row = int(np.prod(leaf.unit_shape[leaf.unit_shard_dim + 1:]))
    assert leaf.storage_group_size == row == shape[-1] and leaf.chunk % row == 0
    x = jax.random.normal(jax.random.key(0), shape)
    stored = logical_to_storage(leaf, x)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), stored) == jax.tree.map(
        lambda a: (a.shape, a.dtype), leaf.param_struct())
    assert jax.tree.structure(stored) == jax.tree.structure(
        leaf.param_spec, is_leaf=lambda a: isinstance(a, jax.sharding.PartitionSpec))
    back = storage_to_logical(leaf, stored)
    assert back.shape == shape
    np.testing.assert_allclose(back, x, atol=float(jnp.abs(x).max()) * 2 / 2 ** bits)
    padded = jax.lax.slice_in_dim(dequantize_partitioned(leaf, stored), shape[leaf.shard_dim],
                                  None, axis=leaf.shard_dim)
    assert padded.size > 0 and float(jnp.abs(padded).sum()) == 0.0   # padding stays zero
    assert leaf.param_bytes_per_device == leaf.layers * leaf.storage_groups * (
        leaf.storage_group_size * bits // 8 + 4)


# ---------------------------------------------------------------------------------------------
# Frozen, float32 storage: exactly the masked single-device run.

@pytest.mark.parametrize("model_name,trainable_name,stage,accumulation", [
    ("lora", "lora_param", 3, 1),
    pytest.param("lora", "lora_b", 3, 2, marks=pytest.mark.slow),
    pytest.param("lora", "lora_param", 2, 1, marks=pytest.mark.slow),
    pytest.param("gpt", "w_fc", 3, 1, marks=pytest.mark.slow),
])
def test_frozen_training_matches_masked_single_device(model_name, trainable_name, stage,
                                                      accumulation):
    model, trainable = _model_and_filter(model_name, trainable_name)
    initial = flat_params(nnx.state(model, nnx.Param))
    frozen = set(initial) - set(flat_params(nnx.state(model, trainable)))
    expected_losses, expected = _reference(model_name, trainable_name)
    if (model_name, stage, accumulation) == ("lora", 3, 1):
        step, state, stored_before, losses = _frozen_run(0)
    else:
        step, state, stored_before, losses = _train(model_name, trainable_name, stage=stage,
                                                    gradient_accumulation_steps=accumulation)

    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    got = flat_params(zeroxla.gather_params(state))
    assert got.keys() == expected.keys()
    for path in expected:
        if path in frozen:
            np.testing.assert_array_equal(got[path], initial[path], err_msg=path)
            np.testing.assert_array_equal(_host(state.params[path]), stored_before[path],
                                          err_msg=path)                # bit-identical storage
        else:
            np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6,
                                       err_msg=path)
            assert not np.allclose(got[path], initial[path]), path            # it trained


# ---------------------------------------------------------------------------------------------
# quantized_nontrainable_weights: frozen partitions stored as int8 codes, quantized once.

def _quantized_leaves(step):
    return [leaf for leaf in step.layout.plan.leaves if leaf.params_quantized]


def test_stored_codes_are_each_devices_partition_and_never_requantized():
    step, state, stored_before, losses = _frozen_run(8)
    assert [leaf.path for leaf in _quantized_leaves(step)] == sorted(QUANTIZED)
    initial = flat_params(nnx.state(_lora_model(), nnx.Param))
    for leaf in _quantized_leaves(step):
        q = state.params[leaf.path]
        assert isinstance(q, StoredCodes) and q.data.dtype == jnp.int8 and leaf.storage_bits == 8
        # Bit-identical after 5 steps: codes and scales were never recomputed.
        np.testing.assert_array_equal(np.asarray(q.data), stored_before[leaf.path].data)
        np.testing.assert_array_equal(np.asarray(q.scales), stored_before[leaf.path].scales)
        # Device d holds the codes of its own partition d, and only those.
        # (numpy: zero-pad the shard dim to a multiple of 8, split it into 8 blocks)
        widths = [(0, 0)] * len(leaf.shape)
        widths[leaf.shard_dim] = (0, leaf.padded_size - leaf.shape[leaf.shard_dim])
        padded = np.pad(initial[leaf.path], widths)
        partitions = [block.reshape(-1) for block in np.split(padded, 8, axis=leaf.shard_dim)]
        assert not leaf.stacked and partitions[0].size == leaf.chunk
        for shard in q.data.addressable_shards:
            assert shard.data.shape == (leaf.storage_groups, leaf.storage_group_size)
            d = shard.index[0].start // leaf.storage_groups
            expected = quantize(partitions[d], bits=8, group_size=leaf.storage_group_size)
            np.testing.assert_array_equal(shard.data, expected.data, err_msg=leaf.path)
        # gather_params gives the dequantized values.
        got = flat_params(zeroxla.gather_params(state))[leaf.path]
        step_size = np.abs(initial[leaf.path]).max() / 128        # int8 symmetric step bound
        np.testing.assert_allclose(got, initial[leaf.path], rtol=0, atol=step_size)
        assert not np.array_equal(got, initial[leaf.path])        # they are quantized
    # Frozen leaves under the persistence threshold stay float32 and untouched.
    np.testing.assert_array_equal(np.asarray(state.params["up/bias"]), initial["up/bias"])


@pytest.mark.parametrize("bits", [8, pytest.param(4, marks=pytest.mark.slow)])
def test_quantized_frozen_training_matches_masked_single_device_on_the_codes(bits):
    """int8 / int4 frozen storage trains exactly like masked single-device optax whose frozen
    weights are the stored codes dequantized in float64 numpy (`_dequantized_codes`): losses
    rtol 1e-5, trainable leaves as in the float32 case; the engine's own dequantization
    (`gather_params`) gives the same values, bit for bit."""
    step, state, stored_before, losses = _frozen_run(bits)
    expected_losses, expected = _reference("lora", "lora_param", bits)
    initial = flat_params(nnx.state(_lora_model(), nnx.Param))
    got = flat_params(zeroxla.gather_params(state))
    for leaf in _quantized_leaves(step):
        codes = _dequantized_codes(leaf, stored_before[leaf.path])
        # the layout is right: within one quantization step of the weights they stand for
        step_size = np.abs(initial[leaf.path]).max() / (2 ** (bits - 1) - 1)
        np.testing.assert_allclose(codes, initial[leaf.path], rtol=0, atol=step_size)
        assert not np.array_equal(codes, initial[leaf.path])            # and they are codes
        np.testing.assert_array_equal(got[leaf.path], codes.astype(np.float32), leaf.path)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert losses[-1] < 0.8 * losses[0]
    for path in TRAINABLE:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)
        assert np.abs(got[path] - initial[path]).max() > 1e-2, path       # the adapters learn


def _payload(report, phase, kind, dtype):
    """Payload bytes of the `kind` collectives in `phase`, counting only `dtype` operands."""
    return sum(operand.num_bytes * (c.group_size if kind == "all-gather" else 1) * c.multiplier
               for c in report.collectives if phase_of(c.op_name) == phase and c.kind == kind
               for operand in c.operands if operand.dtype == dtype)


def test_frozen_gathers_move_int8_codes_and_frozen_leaves_reduce_nothing():
    step, state, _, _ = _frozen_run(8)
    report = comm_report(step, state, _batches()[0])
    frozen = _quantized_leaves(step)
    trainable = [leaf for leaf in step.layout.plan.trainable_leaves if leaf.params_partitioned]
    assert {leaf.path for leaf in trainable} == {"up/lora_b", "down/lora_a"}

    # Forward: every frozen partition travels as int8 codes (+ a float32 scale per group);
    # only the trainable partitions travel as float32.
    codes = sum(8 * leaf.layers * leaf.storage_groups * leaf.storage_group_size for leaf in frozen)
    scales = sum(8 * leaf.layers * leaf.storage_groups * 4 for leaf in frozen)
    assert _payload(report, "zero_fwd_gather", "all-gather", "s8") == codes
    assert _payload(report, "zero_fwd_gather", "all-gather", "f32") == scales + sum(
        4 * leaf.padded_numel for leaf in trainable)
    # Backward re-gathers (the frozen matrices the input gradients need) are codes as well.
    assert _payload(report, "zero_bwd_gather", "all-gather", "s8") > 0
    bwd_f32 = _payload(report, "zero_bwd_gather", "all-gather", "f32")
    assert bwd_f32 <= scales + sum(4 * leaf.padded_numel for leaf in trainable)
    # Gradients: reduce-scatters for the trainable partitioned leaves only, an all-reduce for
    # the trainable persistent ones (lora_a of up, lora_b of down); nothing for frozen leaves.
    assert report.reduce_scatter_bytes() == sum(4 * leaf.padded_numel for leaf in trainable)
    persistent = [leaf for leaf in step.layout.plan.trainable_leaves if not leaf.params_partitioned]
    gradient_all_reduce = sum(4 * leaf.numel for leaf in persistent)
    # (+ at most the two float32 scalars, loss and squared norm, if XLA combines them in)
    assert 0 <= report.all_reduce_bytes("zero_grad_reduce") - gradient_all_reduce <= 8
    rows = {row[0]: row for row in report.parameters}
    assert rows["up/base"][1].startswith("stored int8 codes") and rows["up/base"][3] == (
        "none (frozen)")

    # Against float32 frozen storage: the frozen forward bytes drop to a quarter (+ scales).
    float_step, float_state, _, _ = _frozen_run(0)
    float_report = comm_report(float_step, float_state, _batches()[0])
    float_frozen = sum(8 * leaf.chunk * 4 for leaf in frozen)
    assert float_report.all_gather_bytes("zero_fwd_gather") == float_frozen + sum(
        4 * leaf.padded_numel for leaf in trainable)
    # (A float32 step per group; groups are runs of a row, 64 to 512 elements here: + 1.5%.)
    assert (codes + scales) / float_frozen < 0.26


def test_frozen_quantized_storage_is_a_quarter_of_float32():
    step, state, _, _ = _frozen_run(8)
    float_step, float_state, _, _ = _frozen_run(0)

    def per_device(tree):
        return set(device_bytes(tree).values())

    quantized = per_device({p: state.params[p] for p in QUANTIZED})
    as_float = per_device({p: float_state.params[p] for p in QUANTIZED})
    leaves = _quantized_leaves(step)
    groups = sum(leaf.layers * leaf.storage_groups for leaf in leaves)
    assert as_float == {sum(4 * leaf.layers * leaf.chunk for leaf in leaves)}
    assert quantized == {as_float.pop() // 4 + 4 * groups}       # int8 codes + float32 scales
    assert quantized == {sum(leaf.param_bytes_per_device for leaf in leaves)}

    # The memory report measures it, and the estimate predicts it (no optimizer state either).
    report = zeroxla.memory_report(step.compile(state, _batches()[0]), state, layout=step.layout)
    config = step.layout.config
    estimate = zeroxla.estimate_memory(_lora_model(), step.layout.mesh, config,
                                       trainable=nnx.LoRAParam)
    assert estimate.params == report.params
    assert estimate.optimizer == pytest.approx(report.optimizer, abs=16)   # + Adam's counts
    assert report.gradients == sum(4 * leaf.layers * leaf.chunk       # trainable leaves only
                                   for leaf in step.layout.plan.trainable_leaves)


@pytest.mark.slow
def test_all_of_zeropp_with_a_frozen_layer_stack():
    """The tiny GPT with only the MLP's first matrix trained, under qwZ + hpZ + qgZ and int8
    frozen storage in bf16: the scan slices stored codes per layer, and still never rewrites
    them."""
    zeropp = dict(compute_dtype="bfloat16", quantized_weights=True, hpz_partition_size=4,
                  quantized_gradients=True, persistence_threshold=500)
    step, state, stored_before, losses = _train("gpt", "w_fc", quantized_nontrainable_weights=True,
                                                **zeropp)
    _, _, _, float_losses = _train("gpt", "w_fc", **zeropp)
    assert {leaf.path for leaf in _quantized_leaves(step)} >= {"blocks/layers/wq", "embed/wte"}
    assert step.layout.plan["blocks/layers/wq"].stacked
    for leaf in _quantized_leaves(step):
        for before, after in zip(jax.tree.leaves(stored_before[leaf.path]),
                                 jax.tree.leaves(_host(state.params[leaf.path]))):
            np.testing.assert_array_equal(after, before, err_msg=leaf.path)
    np.testing.assert_allclose(losses, float_losses, rtol=2e-2)
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_fp16_steps_and_overflow_skips_keep_frozen_codes():
    """fp16 with a loss scale (2^22) that trains 3 steps, then overflows: frozen codes stay
    bit-identical through both kinds of step."""
    config = zeroxla.ZeroConfig(stage=3, persistence_threshold=THRESHOLD, compute_dtype="float16",
                                initial_scale_power=22, quantized_nontrainable_weights=True)
    step = zeroxla.make_step(_lora_model(), zeroxla.make_mesh(2, 4), optimizer=_optimizer(),
                             config=config, trainable=nnx.LoRAParam)
    state = step.init()
    stored_before = _host(state.params)
    overflows = []
    for batch in _batches():
        state, metrics = step(state, batch)
        overflows.append(bool(metrics["overflow"]))
    assert any(overflows) and not all(overflows), overflows
    for path in FROZEN:
        for before, after in zip(jax.tree.leaves(stored_before[path]),
                                 jax.tree.leaves(_host(state.params[path]))):
            np.testing.assert_array_equal(after, before, err_msg=path)
    for path in TRAINABLE:      # the persistent ones: a float32 master partition, fp16 copy
        leaf = step.layout.plan[path]
        assert not np.array_equal(np.asarray(storage_to_logical(leaf, state.params[path])),
                                  np.asarray(storage_to_logical(leaf, stored_before[path]))), path


@pytest.mark.slow
def test_int4_storage_packs_two_codes_a_byte():
    step, state, stored_before, _ = _frozen_run(4)
    for leaf in _quantized_leaves(step):
        q = state.params[leaf.path]
        assert leaf.storage_bits == 4
        assert q.data.addressable_shards[0].data.shape == (leaf.storage_groups,
                                                           leaf.storage_group_size // 2)
        np.testing.assert_array_equal(np.asarray(q.data), stored_before[leaf.path].data)

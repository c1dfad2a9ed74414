"""The gated delta rule (`models/gated_delta.py`) against its definition: a float64 numpy
recurrence written here token by token. Both JAX forms equal it within 1e-5 in float32 (relative
to each array's largest value) and 1e-12 in float64, for T = 1, T not a multiple of the chunk,
grouped key heads and an initial state; the chunked form's q / k / v / g / beta gradients equal
the float64 recurrent form's within 1e-5, and those equal central differences of the numpy
recurrence. Both equal transformers' `torch_chunk_gated_delta_rule` /
`torch_recurrent_gated_delta_rule`. A packed row equals its sequences run alone. The chunked
form's compiled gradient's temporaries grow linearly in T, and so do a whole DeltaNet layer's
(`models.gated_deltanet`, the Qwen3.5 presets' shapes, bfloat16) from 4K to 16K tokens. A
DeltaNet layer under DeepSpeed-Ulysses on 2 sequence devices (`DeltaNet.ulysses_mix`: 2 key and
4 value heads split, a packed row's sequence across the device boundary) equals the layer on
the whole sequence in float64: output and the gradients of its input and weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from zeroxla.models import presets
from zeroxla.models.gated_delta import (PAD_SEGMENT, gated_delta_chunked,
                                        gated_delta_recurrent)
from zeroxla.models.gated_deltanet import DeltaNet
from zeroxla.models.qwen3_5 import Qwen3_5Config
from zeroxla.models.sequence_parallel import SequenceParallel

FLOAT32_TOL = 1e-5
FLOAT64_TOL = 1e-12
# Each form compiled whole (eager dispatch would compile every small op apart).
RECURRENT = jax.jit(gated_delta_recurrent, static_argnames="use_qk_l2norm_in_kernel")
CHUNKED = jax.jit(gated_delta_chunked, static_argnames=("chunk", "use_qk_l2norm_in_kernel"))
FORMS = {"recurrent": RECURRENT,
         "chunked": lambda *args, **kw: CHUNKED(*args, chunk=16, **kw)}


def _inputs(seed, b, t, hk, h, dk, dv, dtype=np.float32):
    """q, k [B, T, Hk, K], v [B, T, H, V], g [B, T, H] (Qwen3.5's -exp(A_log) softplus(a + dt)
    range), beta [B, T, H] in (0, 1), an initial state [B, H, K, V]; numpy, in `dtype`."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, b, t, hk, dk))
    v = rng.standard_normal((b, t, h, dv))
    g = -np.exp(rng.uniform(-1.0, 0.5, h)) * np.log1p(np.exp(rng.standard_normal((b, t, h))))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h))))
    state = rng.standard_normal((b, h, dk, dv))
    return tuple(x.astype(dtype) for x in (q, k, v, g, beta, state))


def _reference(q, k, v, g, beta, initial_state=None, l2norm=True):
    """The definition in float64, token by token: S <- exp(g) S; S <- S + k (beta (v - Sᵀk))ᵀ;
    o = Sᵀ q / sqrt(K). Returns (out [B, T, H, V], final state [B, H, K, V])."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, hk, dk = q.shape
    h = v.shape[2]
    q, k = np.repeat(q, h // hk, axis=2), np.repeat(k, h // hk, axis=2)
    if l2norm:
        q, k = (x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6) for x in (q, k))
    q = q / np.sqrt(dk)
    state = (np.zeros((b, h, dk, v.shape[3])) if initial_state is None
             else np.array(initial_state, np.float64))
    out = np.zeros(v.shape)
    for i in range(t):
        state = state * np.exp(g[:, i])[..., None, None]
        read = np.einsum("bhkv,bhk->bhv", state, k[:, i])
        state = state + np.einsum("bhk,bhv->bhkv", k[:, i], beta[:, i, :, None] * (v[:, i] - read))
        out[:, i] = np.einsum("bhkv,bhk->bhv", state, q[:, i])
    return out, state


def _relative_error(got, want):
    """max |got - want| over max(1, max |want|)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want)))


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("t,hk,start", [(1, 2, True), (37, 1, True), (130, 2, False)])
def test_equals_the_float64_recurrence(form, t, hk, start):
    """T = 1, T = 37 and 130 (not multiples of the 16-token chunk), grouped key heads (Hk = 1 of
    H = 2), with and without an initial state."""
    q, k, v, g, beta, state = _inputs(t, 2, t, hk, 2, 8, 16)
    state = state if start else None
    out, final = FORMS[form](q, k, v, g, beta, initial_state=state, use_qk_l2norm_in_kernel=True)
    want_out, want_final = _reference(q, k, v, g, beta, state)
    assert out.dtype == jnp.float32 and final.dtype == jnp.float32
    assert _relative_error(out, want_out) < FLOAT32_TOL
    assert _relative_error(final, want_final) < FLOAT32_TOL


def test_both_forms_in_float64():
    """The algebra, not float32 round-off: chunks of 16 over T = 37, the default chunk of 64
    over T = 130, and unit-norm keys without the in-kernel l2norm."""
    with jax.enable_x64(True):
        for t, chunk in ((37, 16), (130, 64)):
            q, k, v, g, beta, state = _inputs(t, 2, t, 1, 2, 8, 8, np.float64)
            k = k / np.linalg.norm(k, axis=-1, keepdims=True)
            want = _reference(q, k, v, g, beta, state, l2norm=False)
            for fn in (RECURRENT, lambda *a, **kw: CHUNKED(*a, chunk=chunk, **kw)):
                got = fn(q, k, v, g, beta, initial_state=state)
                for got_x, want_x in zip(got, want):
                    assert got_x.dtype == jnp.float64
                    assert _relative_error(got_x, want_x) < FLOAT64_TOL


def _loss(fn, cot, cot_state):
    """A scalar of the outputs and the final state (random cotangents), as a function of
    (q, k, v, g, beta)."""
    def loss(*args):
        out, final = fn(*args[:5], initial_state=args[5], use_qk_l2norm_in_kernel=True)
        return jnp.sum(out * cot) + jnp.sum(final * cot_state)
    return loss


def test_recurrent_gradients_equal_finite_differences_of_the_numpy_recurrence():
    """Directional derivatives of the float64 recurrent form along random directions of every
    input at once equal central differences of `_reference` (error O(eps²) ~ 1e-10)."""
    with jax.enable_x64(True):
        args = _inputs(1, 2, 9, 1, 2, 4, 4, np.float64)
        rng = np.random.default_rng(2)
        cot, cot_state = rng.standard_normal((2, 9, 2, 4)), rng.standard_normal((2, 2, 4, 4))
        grads = jax.jit(jax.grad(_loss(RECURRENT, cot, cot_state), argnums=range(6)))(*args)
        for seed in range(3):
            direction = [np.random.default_rng(10 + seed).standard_normal(x.shape) for x in args]
            eps = 1e-5

            def numpy_loss(sign):
                out, final = _reference(*(x + sign * eps * d for x, d in zip(args, direction)))
                return np.sum(out * cot) + np.sum(final * cot_state)

            numeric = (numpy_loss(1) - numpy_loss(-1)) / (2 * eps)
            analytic = sum(np.sum(np.asarray(gr) * d) for gr, d in zip(grads, direction))
            assert abs(analytic - numeric) < 1e-8 * max(1.0, abs(numeric)), (analytic, numeric)


@pytest.mark.parametrize("t", [1, 130])
def test_chunked_gradients_equal_the_float64_recurrent_gradients(t):
    """The chunked form's float32 gradients of q, k, v, g, beta and the initial state against
    the float64 recurrent form's (checked above against the numpy recurrence)."""
    args = _inputs(3, 2, t, 1, 2, 8, 16)
    rng = np.random.default_rng(4)
    cot, cot_state = rng.standard_normal((2, t, 2, 16)), rng.standard_normal((2, 2, 8, 16))
    chunked = _loss(FORMS["chunked"], cot.astype(np.float32), cot_state.astype(np.float32))
    got = jax.jit(jax.grad(chunked, argnums=range(6)))(*args)
    with jax.enable_x64(True):
        want = jax.jit(jax.grad(_loss(RECURRENT, cot, cot_state), argnums=range(6)))(
            *(x.astype(np.float64) for x in args))
        want = [np.asarray(x) for x in want]
    for name, got_x, want_x in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        assert got_x.dtype == jnp.float32
        assert _relative_error(got_x, want_x) < FLOAT32_TOL, name


@pytest.mark.parametrize("t,hk,chunk", [(37, 1, 16), (130, 2, 64)])
def test_equals_transformers_torch_functions(t, hk, chunk):
    """transformers' torch chunked and recurrent functions (Qwen3.5's, in float32) on the same
    inputs, grouped key heads and an initial state included: outputs and final states."""
    torch = pytest.importorskip("torch")
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta, state = _inputs(5, 2, t, hk, 2, 16, 8)
    tensors = [torch.from_numpy(x) for x in (q, k, v, g, beta)]
    options = dict(initial_state=torch.from_numpy(state), output_final_state=True,
                   use_qk_l2norm_in_kernel=True)
    torch_forms = {"chunked": qwen3_5.torch_chunk_gated_delta_rule(*tensors, chunk_size=chunk,
                                                                  **options),
                   "recurrent": qwen3_5.torch_recurrent_gated_delta_rule(*tensors, **options)}
    ours = {"chunked": CHUNKED(q, k, v, g, beta, chunk=chunk, initial_state=state,
                               use_qk_l2norm_in_kernel=True),
            "recurrent": RECURRENT(q, k, v, g, beta, initial_state=state,
                                   use_qk_l2norm_in_kernel=True)}
    for form, (want_out, want_final) in torch_forms.items():
        out, final = ours[form]
        assert _relative_error(out, want_out.numpy()) < FLOAT32_TOL, form
        assert _relative_error(final, want_final.numpy()) < FLOAT32_TOL, form


# Two packed rows (segment id, length): a segment starting inside a 16-token chunk, padding
# tails, and a row led by padding (its first segment still starts from the initial state).
PACKING = (((1, 20), (2, 13), (PAD_SEGMENT, 4)),
           ((PAD_SEGMENT, 3), (4, 5), (7, 27), (PAD_SEGMENT, 2)))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_packed_row_equals_its_sequences_run_alone(form):
    """Each segment's outputs equal `_reference` on that sequence alone (the row's first segment
    from the row's initial state, the others from zeros); padding gives zeros; the final state
    is the last segment's."""
    q, k, v, g, beta, state = _inputs(6, 2, 37, 1, 2, 8, 8)
    rows = [np.repeat([s for s, _ in row], [n for _, n in row]) for row in PACKING]
    segment_ids = jnp.asarray(np.stack(rows), jnp.int32)                          # [2, 37]
    out, final = FORMS[form](q, k, v, g, beta, initial_state=state, segment_ids=segment_ids,
                             use_qk_l2norm_in_kernel=True)
    out = np.asarray(out)
    for row, segments in enumerate(PACKING):
        start, first = 0, True
        for segment, length in segments:
            span = slice(start, start + length)
            start += length
            if segment == PAD_SEGMENT:
                assert np.all(out[row, span] == 0.0)
                continue
            alone = [x[row:row + 1, span] for x in (q, k, v, g, beta)]
            want_out, want_final = _reference(*alone, state[row:row + 1] if first else None)
            first = False
            assert _relative_error(out[row, span], want_out[0]) < FLOAT32_TOL, (row, segment)
        assert _relative_error(final[row], want_final[0]) < FLOAT32_TOL, row


def test_packed_gradients_equal_the_float64_recurrent_gradients():
    """The chunked form's gradients through a packed row (a reset inside a chunk, padding) equal
    the float64 recurrent form's; padding tokens get none."""
    args = _inputs(7, 2, 37, 1, 2, 8, 8)
    rows = [np.repeat([s for s, _ in row], [n for _, n in row]) for row in PACKING]
    segment_ids = jnp.asarray(np.stack(rows), jnp.int32)
    rng = np.random.default_rng(8)
    cot, cot_state = rng.standard_normal((2, 37, 2, 8)), rng.standard_normal((2, 2, 8, 8))

    def packed(fn):
        return lambda *a, **kw: fn(*a, segment_ids=segment_ids, **kw)

    chunked = _loss(packed(FORMS["chunked"]), cot.astype(np.float32),
                    cot_state.astype(np.float32))
    got = jax.jit(jax.grad(chunked, argnums=range(6)))(*args)
    with jax.enable_x64(True):
        want = jax.jit(jax.grad(_loss(packed(RECURRENT), cot, cot_state), argnums=range(6)))(
            *(x.astype(np.float64) for x in args))
        want = [np.asarray(x) for x in want]
    padding = np.stack(rows) == PAD_SEGMENT
    for name, got_x, want_x in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        assert _relative_error(got_x, want_x) < FLOAT32_TOL, name
        if name != "state":
            assert np.all(np.asarray(got_x)[padding] == 0.0), name


# Two packed rows of 32 tokens (segment id, length), 16 per sequence device: a sequence across
# the device boundary (between tokens 15 and 16), one starting right at it, padding at the ends.
ULYSSES_PACKING = (((1, 11), (2, 14), (3, 5), (PAD_SEGMENT, 2)),
                   ((5, 16), (6, 13), (PAD_SEGMENT, 3)))


def test_ulysses_layer_equals_the_layer_on_the_whole_sequence():
    """One DeltaNet layer (2 key heads, 4 value heads, each conv filter its own) under Ulysses
    on a 2-device sequence axis, each device holding 16 of a packed row's 32 tokens: the
    all-to-alls give device r key heads r and value heads 2r, 2r + 1 with those heads' conv
    filters and the gathered segment ids. Its output and the gradients of its input h and of
    every weight equal the unsplit layer's, in float64 within 1e-12 of each array's largest
    value (in float32 the weights' gradients differ by summation order, about 1e-5)."""
    config = Qwen3_5Config(d_model=16, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=8, linear_value_head_dim=8,
                           linear_conv_kernel_dim=4)
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: DeltaNet(config, nnx.Rngs(0))))
    rng = np.random.default_rng(11)
    # every weight N(0, 0.3²) in float64, drawn here: no init program to compile
    weights = jax.tree.map(lambda x: 0.3 * rng.standard_normal(x.shape), shapes)
    h, cot = rng.standard_normal((2, 2, 32, 16))                                  # [B, T, D]
    rows = [np.repeat([s for s, _ in row], [n for _, n in row]) for row in ULYSSES_PACKING]
    segment_ids = np.stack(rows).astype(np.int32)                                 # [B, T]
    sequence = SequenceParallel("sequence", 2, "ulysses")
    tokens = P(None, "sequence")
    ulysses = jax.shard_map(
        lambda w, h, seg: nnx.merge(graphdef, w)(h, None, seg, sequence),
        mesh=Mesh(np.asarray(jax.devices()[:2]), ("sequence",)),
        in_specs=(P(), tokens, tokens), out_specs=tokens, check_vma=False)

    def loss(layer):
        def value(w, h):
            out = layer(w, h, segment_ids)                                        # [B, T, D]
            return jnp.sum(out * cot), out
        return jax.jit(jax.value_and_grad(value, argnums=(0, 1), has_aux=True))

    with jax.enable_x64(True):
        (_, want), want_grads = loss(lambda w, h, seg: nnx.merge(graphdef, w)(h, None, seg))(
            weights, h)
        (_, got), got_grads = loss(ulysses)(weights, h)
    assert got.dtype == jnp.float64 and np.max(np.abs(np.asarray(want))) > 1.0
    assert _relative_error(got, want) < FLOAT64_TOL
    got_leaves = jax.tree_util.tree_flatten_with_path(got_grads)[0]
    want_leaves = jax.tree.leaves(want_grads)
    assert len(got_leaves) == len(want_leaves) == 14          # h and the layer's 13 weights
    for (path, got_x), want_x in zip(got_leaves, want_leaves):
        assert got_x.dtype == jnp.float64
        assert _relative_error(got_x, want_x) < FLOAT64_TOL, jax.tree_util.keystr(path)


def test_bfloat16_inputs_accumulate_in_float32():
    """bfloat16 q, k, v, g, beta: outputs in bfloat16, the state float32, both within bfloat16's
    rounding of the float64 recurrence on the same (rounded) inputs."""
    args = [jnp.asarray(x, jnp.bfloat16) for x in _inputs(9, 2, 130, 2, 2, 8, 8)[:5]]
    want_out, want_final = _reference(*(np.asarray(x, np.float64) for x in args))
    out, final = CHUNKED(*args, use_qk_l2norm_in_kernel=True)
    assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert _relative_error(out, want_out) < 1e-2
    assert _relative_error(final, want_final) < 1e-4


def _compiled_temporaries(t):
    """Bytes of temporaries of the chunked form's compiled gradient, B = 1, H = 2, K = V = 16."""
    def loss(q, k, v, g, beta):
        out, final = gated_delta_chunked(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        return jnp.sum(out * out) + jnp.sum(final)

    shapes = [(1, t, 2, 16)] * 3 + [(1, t, 2)] * 2
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
    program = jax.jit(jax.grad(loss, argnums=range(5))).lower(*args).compile()
    return program.memory_analysis().temp_size_in_bytes


def test_gradient_temporaries_grow_linearly():
    """Each doubling of T from 1024 to 4096 at most 2.1x the compiled gradient's temporaries
    (O(T²) would be 4x): the chunk bodies are rematerialised, one state kept per chunk."""
    temps = [_compiled_temporaries(t) for t in (1024, 2048, 4096)]
    for short, long in zip(temps, temps[1:]):
        assert long / short <= 2.1, temps


def _layer_temporaries(name, t):
    """Bytes of temporaries of one DeltaNet layer's forward + backward (the gradients of its
    weights and of its input h [1, t, D]), bfloat16 weights and input as a bf16 step computes
    them, the layer of preset `name`; compiled on abstract arrays, nothing runs."""
    config = presets.config(name)
    graphdef, weights = nnx.split(nnx.eval_shape(lambda: DeltaNet(config, nnx.Rngs(0))))
    weights = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), weights)

    def loss(weights, h):
        out = nnx.merge(graphdef, weights)(h, None)                                # [1, T, D]
        return jnp.sum(jnp.square(out.astype(jnp.float32)))

    h = jax.ShapeDtypeStruct((1, t, config.d_model), jnp.bfloat16)
    program = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(weights, h).compile()
    return program.memory_analysis().temp_size_in_bytes


@pytest.mark.slow                                # 6 compiles, about 4 s each
@pytest.mark.parametrize("name", ["Qwen3.5-27B", "Qwen3.5-35B-A3B"])
def test_layer_temporaries_grow_linearly_to_16k(name):
    """A real-size DeltaNet layer's forward + backward: each doubling of T from 4,096 to
    16,384 at most 2.1x the compiled temporaries (O(T²) would be 4x)."""
    temps = [_layer_temporaries(name, t) for t in (4096, 8192, 16384)]
    for short, long in zip(temps, temps[1:]):
        assert long / short <= 2.1, temps


@pytest.mark.parametrize("change,message", [
    (dict(k=np.zeros((2, 5, 2, 4), np.float32)), "q and k"),
    (dict(v=np.zeros((2, 5, 3, 4), np.float32)), "v must be"),
    (dict(g=np.zeros((2, 5, 1), np.float32)), "g must be"),
    (dict(initial_state=np.zeros((2, 2, 4, 3), np.float32)), "initial_state"),
    (dict(segment_ids=np.zeros((2, 5), np.float32)), "segment_ids"),
    (dict(chunk=0), "chunk=0")])
def test_refuses_shapes_it_does_not_take(change, message):
    q, k, v, g, beta, _ = _inputs(0, 2, 5, 2, 2, 8, 4)
    arguments = dict(q=q, k=k, v=v, g=g, beta=beta) | change
    with pytest.raises(ValueError, match=message):
        gated_delta_chunked(**arguments)

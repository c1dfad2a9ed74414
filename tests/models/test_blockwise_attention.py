"""`blockwise_attention` equals the naive `layers.causal_attention`, forward and dq / dk / dv (a
random cotangent through `jax.vjp`), within 2e-6 in float32 (issue 51's bound, relative to each
array's largest value where that is over 1) and 1e-12 in float64: causal, GQA, sliding window,
soft-cap with a Gemma-like scale, packed segments with a padding tail, lengths that are not a
multiple of the blocks, and shorter than one block. It visits exactly the blocks the mask leaves
some key of. And it is memory-linear: the compiled gradient's temporaries about double from
T = 2048 to 4096 (the naive path's about quadruple) and no buffer of the compiled program holds
T * T elements."""

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from zeroxla.analysis import hlo_text
from zeroxla.models import layers
from zeroxla.models import blockwise_attention as blockwise
from zeroxla.models.blockwise_attention import PAD_SEGMENT, blockwise_attention

FLOAT32_TOL = 2e-6
FLOAT64_TOL = 1e-12


def _inputs(seed, b, t, h, g, d, dtype=jnp.float32, q_gain=1.0):
    """q [B, T, H, K], k, v [B, T, G, K] and an output cotangent [B, T, H, K], standard normal
    (q times `q_gain`, to push scores into the soft-cap's curve)."""
    rng = np.random.default_rng(seed)
    shapes = ((b, t, h, d), (b, t, g, d), (b, t, g, d), (b, t, h, d))
    q, k, v, cot = (rng.standard_normal(shape) for shape in shapes)
    return tuple(jnp.asarray(x, dtype) for x in (q * q_gain, k, v, cot))


def _segment_reference(q, k, v, segment_ids, *, window=None, scale=None, softcap=None):
    """The naive path with a segment mask (written here, not taken from the module under test):
    query t sees key s when causal / in the window and of t's segment; padding rows give 0."""
    b, t, h, d = q.shape
    g = k.shape[2]
    scores = layers.attention_scores(q.reshape(b, t, g, h // g, d), k, scale, softcap)
    pos = jnp.arange(t)
    mask = layers.visible_keys(pos[:, None], pos[None, :], window)               # [T, S]
    real = segment_ids != PAD_SEGMENT                                             # [B, T]
    mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :]) & real[:, :, None]
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BGRTS,BSGK->BTGRK", probs, v).reshape(b, t, h, d)
    return out * real[:, :, None, None]


def _max_errors(attention, reference, q, k, v, cot):
    """Max |blockwise - reference| of the output and of dq, dk, dv, each over max(1, max
    |reference|): float32 round-off scales with the values, and dv (a sum over every query of a
    group) reaches ~7 here, where one float32 ulp is 5e-7 (the naive path itself is 1.8e-6 from
    float64 there; the blockwise one 0.9e-6)."""
    def forward_and_grads(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(cot))

    got = jax.jit(lambda: forward_and_grads(attention))()
    want = jax.jit(lambda: forward_and_grads(reference))()
    return {name: float(jnp.max(jnp.abs(a - b)) / jnp.maximum(1.0, jnp.max(jnp.abs(b))))
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def _check(inputs, tol=FLOAT32_TOL, **options):
    """Blockwise (with `options`, block sizes included) against `causal_attention`."""
    attention_options = {key: options[key] for key in ("window", "scale", "softcap")
                         if key in options}
    errors = _max_errors(lambda q, k, v: blockwise_attention(q, k, v, **options),
                         lambda q, k, v: layers.causal_attention(q, k, v, **attention_options),
                         *inputs)
    assert max(errors.values()) < tol, errors
    return errors


def test_causal():
    _check(_inputs(0, 2, 64, 4, 4, 16), q_block=16, kv_block=16)


@pytest.mark.slow                   # daily: GQA in test_every_option_together_in_float64
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_grouped_query_heads(kv_heads):
    _check(_inputs(1, 2, 64, 4, kv_heads, 16), q_block=16, kv_block=32)


@pytest.mark.slow                   # daily: a window in test_every_option_together_in_float64
@pytest.mark.parametrize("window", [5, 20, 100])
def test_sliding_window(window):
    """Windows narrower than a block, spanning blocks, and wider than the sequence."""
    _check(_inputs(2, 2, 64, 4, 2, 16), window=window, q_block=16, kv_block=16)


@pytest.mark.slow                   # daily: both in test_every_option_together_in_float64
def test_softcap_and_scale():
    """Gemma 2: scores times query_pre_attn_scalar ** -0.5, soft-capped; q scaled up so that
    many scores lie where tanh bends."""
    _check(_inputs(3, 2, 48, 4, 2, 16, q_gain=4.0), scale=24 ** -0.5, softcap=3.0,
           q_block=16, kv_block=16)


@pytest.mark.slow                   # daily: T = 37 in test_every_option_together_in_float64
@pytest.mark.parametrize("q_block,kv_block", [(16, 16), (16, 8), (8, 16)])
def test_length_not_a_multiple_of_the_blocks(q_block, kv_block):
    _check(_inputs(4, 2, 37, 4, 2, 16), window=11, q_block=q_block, kv_block=kv_block)


def test_shorter_than_one_block():
    _check(_inputs(5, 2, 5, 4, 2, 16))                       # default blocks, T = 5


def test_every_option_together_in_float64():
    """The algebra, not float32 round-off: GQA, window, soft-cap, scale, odd T in float64."""
    with jax.enable_x64(True):
        inputs = _inputs(6, 2, 37, 4, 2, 16, dtype=jnp.float64, q_gain=3.0)
        _check(inputs, tol=FLOAT64_TOL, window=13, scale=0.2, softcap=4.0,
               q_block=16, kv_block=8)


# Two rows, each three packed sequences and a padding tail (segment 0), of different lengths.
SEGMENT_LENGTHS = (((1, 10), (2, 17), (3, 13), (PAD_SEGMENT, 8)),
                   ((1, 20), (2, 5), (3, 15), (PAD_SEGMENT, 8)))


def _segment_ids():
    rows = [np.repeat([s for s, _ in row], [n for _, n in row]) for row in SEGMENT_LENGTHS]
    return jnp.asarray(np.stack(rows), jnp.int32)                                 # [2, 48]


@pytest.mark.parametrize("window", [None, pytest.param(6, marks=pytest.mark.slow)])
def test_segment_ids(window):
    segment_ids = _segment_ids()
    q, k, v, cot = _inputs(7, 2, 48, 4, 2, 16)
    options = {"window": window, "softcap": 5.0}
    errors = _max_errors(
        lambda q, k, v: blockwise_attention(q, k, v, segment_ids=segment_ids, q_block=16,
                                            kv_block=16, **options),
        lambda q, k, v: _segment_reference(q, k, v, segment_ids, **options), q, k, v, cot)
    assert max(errors.values()) < FLOAT32_TOL, errors


@pytest.mark.parametrize("window", [None, pytest.param(6, marks=pytest.mark.slow)])
def test_naive_segment_mask_equals_the_reference(window):
    """`layers.causal_attention`'s own segment mask (the "naive" implementation of a packed
    batch) against the reference written here, forward and dq / dk / dv."""
    segment_ids = _segment_ids()
    q, k, v, cot = _inputs(11, 2, 48, 4, 2, 16)
    options = {"window": window, "softcap": 5.0}
    errors = _max_errors(
        lambda q, k, v: layers.causal_attention(q, k, v, segment_ids=segment_ids, **options),
        lambda q, k, v: _segment_reference(q, k, v, segment_ids, **options), q, k, v, cot)
    assert max(errors.values()) < FLOAT32_TOL, errors


@pytest.mark.slow                   # a heavier variant of test_segment_ids[None]
def test_segment_ids_with_every_option_and_an_odd_length_equal_naive():
    """Blockwise against the naive segment mask: GQA, window, soft-cap and scale, T = 45 (no
    multiple of the blocks), the padding tail cut to 5."""
    segment_ids = _segment_ids()[:, :45]
    q, k, v, cot = _inputs(12, 2, 45, 4, 2, 16, q_gain=3.0)
    options = {"window": 9, "softcap": 4.0, "scale": 0.3}
    errors = _max_errors(
        lambda q, k, v: blockwise_attention(q, k, v, segment_ids=segment_ids, q_block=16,
                                            kv_block=8, **options),
        lambda q, k, v: layers.causal_attention(q, k, v, segment_ids=segment_ids, **options),
        q, k, v, cot)
    assert max(errors.values()) < FLOAT32_TOL, errors


@pytest.mark.slow                   # daily: test_segment_ids[None]'s reference zeroes padding
def test_padding_segment_gives_zeros_and_no_gradient():
    segment_ids = _segment_ids()
    q, k, v, cot = _inputs(8, 2, 48, 4, 2, 16)
    out, vjp = jax.vjp(lambda q, k, v: blockwise_attention(
        q, k, v, segment_ids=segment_ids, q_block=16, kv_block=16), q, k, v)
    pad = np.asarray(segment_ids == PAD_SEGMENT)                                  # [B, T]
    for name, x in zip(("out", "dq", "dk", "dv"), (out, *vjp(cot))):
        assert np.all(np.isfinite(x)), name
        assert np.all(np.asarray(x)[pad] == 0), name


def test_segment_ids_against_numpy_float64():
    """The forward against plain numpy in float64: each segment on its own, causal softmax."""
    segment_ids = _segment_ids()
    q, k, v, _ = _inputs(9, 2, 48, 4, 2, 16)
    got = np.asarray(blockwise_attention(q, k, v, segment_ids=segment_ids, q_block=16,
                                         kv_block=16))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    kn, vn = np.repeat(kn, 2, axis=2), np.repeat(vn, 2, axis=2)                   # heads of a group
    want = np.zeros_like(qn)
    for row, segments in enumerate(SEGMENT_LENGTHS):
        start = 0
        for segment, n in segments:
            span = slice(start, start + n)
            start += n
            if segment == PAD_SEGMENT:
                continue
            scores = np.einsum("thk,shk->hts", qn[row, span], kn[row, span]) / 4.0  # sqrt(16)
            scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            want[row, span] = np.einsum("hts,shk->thk", probs, vn[row, span])
    assert np.max(np.abs(got - want)) < FLOAT32_TOL


def test_refuses_shapes_it_does_not_take():
    q, k, v, _ = _inputs(10, 1, 8, 3, 2, 4)
    with pytest.raises(ValueError, match="not a multiple"):
        blockwise_attention(q, k, v)
    q, k, v, _ = _inputs(10, 1, 8, 4, 2, 4)
    with pytest.raises(ValueError, match="segment_ids"):
        blockwise_attention(q, k, v, segment_ids=jnp.zeros((1, 7), jnp.int32))
    with pytest.raises(ValueError, match="window=0"):
        blockwise_attention(q, k, v, window=0)


@pytest.mark.parametrize("offset", [0, 24])
@pytest.mark.parametrize("t,q_block,kv_block,window",
                         [(64, 16, 16, None), (37, 16, 8, None), (37, 8, 16, 11),
                          (64, 16, 16, 5), (64, 16, 32, 20), (100, 32, 16, 40)])
def test_loops_visit_exactly_the_blocks_with_a_visible_key(t, q_block, kv_block, window, offset):
    """The forward's key/value range per query block and the backward's query range per
    key/value block are the blocks of the padded [Tq, Tk] mask that hold a visible entry; with
    the queries a chunk at `offset` (context parallelism) as well."""
    plan = blockwise._Plan(window, None, None, q_block, kv_block)
    nq, nk = -(-(t - offset) // q_block), -(-t // kv_block)
    pos_q, pos_k = offset + np.arange(nq * q_block), np.arange(nk * kv_block)
    mask = np.asarray(layers.visible_keys(pos_q[:, None], pos_k[None, :], window))
    any_visible = mask.reshape(nq, q_block, nk, kv_block).any(axis=(1, 3))     # [nq, nk]
    for i in range(nq):
        lo, hi = (int(x) for x in blockwise._kv_range(plan, i, nk, offset))
        assert list(range(lo, hi)) == list(np.flatnonzero(any_visible[i])), i
    for j in range(nk):
        lo, hi = (int(x) for x in blockwise._query_range(plan, j, nq, offset))
        assert list(range(lo, hi)) == list(np.flatnonzero(any_visible[:, j])), j


@pytest.mark.parametrize("window,packed", [pytest.param(None, False, marks=pytest.mark.slow),
                                           (7, True)])
def test_a_chunk_of_queries_at_an_offset_equals_those_rows_of_the_whole(window, packed):
    """`blockwise_attention_at`: the queries of positions [s, s + c) against all keys give the
    rows [s, s + c) of the naive attention of the whole sequence, and their gradients; with the
    offset traced (context parallelism reads it from the device's place)."""
    rng = np.random.default_rng(5)
    t, s, c = 40, 16, 12
    q = jnp.asarray(rng.standard_normal((2, t, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, t, 2, 8)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.repeat([[1] * 22 + [2] * 15 + [0] * 3], 2, 0), jnp.int32)
    segments = seg if packed else None
    cot = jnp.asarray(rng.standard_normal((2, c, 4, 8)), jnp.float32)

    def chunk(q, k, v, offset):
        out = blockwise.blockwise_attention_at(
            lax.dynamic_slice_in_dim(q, offset, c, 1), k, v, offset, window=window,
            q_segment_ids=None if segments is None else segments[:, s:s + c],
            kv_segment_ids=segments, q_block=8, kv_block=8)
        return jnp.sum(out * cot), out

    def whole(q, k, v, segments, cot):
        out = layers.causal_attention(q, k, v, window=window, segment_ids=segments)[:, s:s + c]
        return jnp.sum(out * cot), out

    (_, got), got_grads = jax.jit(jax.value_and_grad(chunk, (0, 1, 2), has_aux=True))(
        q, k, v, jnp.int32(s))
    (_, want), want_grads = jax.jit(jax.value_and_grad(whole, (0, 1, 2), has_aux=True))(
        q, k, v, segments, cot)                                   # one program, not op by op
    np.testing.assert_allclose(got, want, atol=2e-6)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=2e-6)


# ---- memory, read from the compiled gradient -----------------------------------------------

LENGTHS = (2048, 4096)


def _compiled_gradient(attention, t):
    """The compiled d sum(attention(q, k, v)) / d(q, k, v) at B = 1, H = G = 2, K = 32."""
    q = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)
    loss = lambda q, k, v: attention(q, k, v).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()


@pytest.fixture(scope="module")
def compiled():
    paths = {"naive": layers.causal_attention,
             "blockwise": lambda q, k, v: blockwise_attention(q, k, v, q_block=256,
                                                              kv_block=256)}
    return {(name, t): _compiled_gradient(fn, t) for name, fn in paths.items() for t in LENGTHS}


def _temp_bytes(program) -> int:
    return program.memory_analysis().temp_size_in_bytes


@pytest.mark.slow                   # compiles four T = 2048 / 4096 gradients
def test_temporaries_grow_linearly(compiled):
    short, long = LENGTHS
    naive = _temp_bytes(compiled["naive", long]) / _temp_bytes(compiled["naive", short])
    blockwise = (_temp_bytes(compiled["blockwise", long])
                 / _temp_bytes(compiled["blockwise", short]))
    assert naive >= 3.5, naive                       # the test can tell T² from T
    assert blockwise <= 2.2, blockwise


def _largest_buffer(program) -> int:
    """The most elements of any array in the compiled program's HLO text."""
    module = hlo_text.parse_module(program.as_text())
    return max(array.num_elements for computation in module.computations.values()
               for instruction in computation.instructions
               for array in hlo_text.parse_shape(instruction.shape))


@pytest.mark.slow
@pytest.mark.parametrize("t", LENGTHS)
def test_no_buffer_holds_t_squared_elements(compiled, t):
    assert _largest_buffer(compiled["naive", t]) >= t * t        # the check can see one
    assert _largest_buffer(compiled["blockwise", t]) < t * t

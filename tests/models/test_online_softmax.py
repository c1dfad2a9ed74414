"""The online-softmax core (`models.online_softmax`) against a float64 numpy softmax over all
blocks at once: random scores and values in blocks under random masks, with rows that see no
key at all and blocks no row sees, scores whose block maxima move up and down (the rescale),
within 1e-12; the merge of the two halves' partial results against the whole."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroxla.models import online_softmax

B, T, S, K, BLOCKS = 2, 7, 5, 3, 6          # rows [B, T]; each block S keys of K values
SPEC = "BTS,BSK->BTK"


def _blocks(seed):
    """scores [n, B, T, S], values [n, B, S, K], visible bool [n, B, T, S] (float64 numpy):
    row (0, 0) sees nothing, block 2 is hidden from every row, block 4's scores are 60 above
    the others (its max replaces the running one, then stays)."""
    rng = np.random.default_rng(seed)
    scores = 4.0 * rng.standard_normal((BLOCKS, B, T, S))
    scores[4] += 60.0
    scores[1] -= 30.0
    values = rng.standard_normal((BLOCKS, B, S, K))
    visible = rng.random((BLOCKS, B, T, S)) < 0.6
    visible[:, 0, 0] = False
    visible[2] = False
    return scores, values, visible


def _numpy_softmax(scores, values, visible):
    """float64: (out [B, T, K], lse [B, T]) of the softmax over every block's visible keys at
    once; a row that sees nothing: out 0, lse -inf."""
    s = np.concatenate(list(scores), axis=-1)                             # [B, T, n S]
    vals = np.concatenate(list(values), axis=-2)                          # [B, n S, K]
    mask = np.concatenate(list(visible), axis=-1)
    out, lse = np.zeros((B, T, K)), np.full((B, T), -np.inf)
    for b in range(B):
        for t in range(T):
            seen = mask[b, t]
            if seen.any():
                top = s[b, t, seen].max()
                w = np.exp(s[b, t, seen] - top)
                out[b, t] = w @ vals[b, seen] / w.sum()
                lse[b, t] = top + np.log(w.sum())
    return out, lse


def _core(scores, values, visible, empty_lse):
    state = online_softmax.start((B, T), K, jnp.float64)
    for j in range(scores.shape[0]):
        state = online_softmax.step(state, jnp.asarray(scores[j]), jnp.asarray(values[j]),
                                    jnp.asarray(visible[j]), SPEC)
    return online_softmax.finish(state, empty_lse)


@pytest.mark.parametrize("seed", [0, 1])
def test_blocks_equal_one_softmax_over_all_of_them_in_float64(seed):
    scores, values, visible = _blocks(seed)
    want_out, want_lse = _numpy_softmax(scores, values, visible)
    with jax.enable_x64(True):
        out, lse = _core(scores, values, visible, jnp.inf)
        assert out.dtype == lse.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=0, atol=1e-12)
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], rtol=1e-12, atol=0)
    # a row that saw nothing: exactly 0 out and the lse the caller asked for
    assert not seen[0, 0]
    assert np.all(np.asarray(out)[~seen] == 0.0) and np.all(np.asarray(lse)[~seen] == np.inf)


def test_merge_of_two_halves_equals_the_whole_in_float64():
    scores, values, visible = _blocks(2)
    visible[3:, 1, 2] = False                     # row (1, 2) sees keys in the first half only
    visible[:3, 1, 4] = False                     # row (1, 4) in the second half only
    want_out, want_lse = _numpy_softmax(scores, values, visible)
    with jax.enable_x64(True):
        first = _core(scores[:3], values[:3], visible[:3], -jnp.inf)
        second = _core(scores[3:], values[3:], visible[3:], -jnp.inf)
        out, lse = online_softmax.merge(*first, *second)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=0, atol=1e-12)
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], rtol=1e-12, atol=0)
    assert np.all(np.asarray(out)[~seen] == 0.0) and np.all(np.asarray(lse)[~seen] == -np.inf)

"""A layer's loop-invariant residuals: found through plain calls, computed from the consts alone,
never taken from a varying input or an effectful equation."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from zeroxla.engine.invariant_residuals import hoist_invariant

T = 4


@jax.jit
def _masked(scores):                       # [B, T, T]: one call making a constant and a variable
    mask = jnp.tril(jnp.ones((T, T), bool))
    return jnp.broadcast_to(mask, scores.shape), jnp.where(mask, scores, -1.0)


def _kept(varying, consts):
    w, x = varying                         # w [D, T], x [B, T, D]
    (positions,) = consts                  # [T]
    scores = x @ w                         # [B, T, T]
    mask, masked = _masked(scores)
    called = io_callback(lambda: np.ones(3, np.float32), jax.ShapeDtypeStruct((3,), jnp.float32),
                         ordered=True)
    return [masked, mask, positions * 2.0, scores, called, jnp.float32(0.5) * positions]


def _inputs():
    w = np.arange(3 * T, dtype=np.float32).reshape(3, T)
    x = np.linspace(-1, 1, 2 * T * 3, dtype=np.float32).reshape(2, T, 3)
    return (w, x), (np.arange(T, dtype=np.float32),)


def test_constant_and_consts_residuals_are_hoisted_and_computed_from_the_consts_alone():
    """Varying inputs given as shapes only: the hoisted values cannot read them."""
    (w, x), consts = _inputs()
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (w, x))
    hoisted = hoist_invariant(_kept, shapes, consts)
    assert hoisted.slots == (1, 2, 5) and hoisted.size == 6
    mask, doubled, halved = hoisted.values
    np.testing.assert_array_equal(mask, np.broadcast_to(np.tril(np.ones((T, T), bool)),
                                                        (2, T, T)))
    np.testing.assert_array_equal(doubled, 2.0 * consts[0])
    np.testing.assert_array_equal(halved, 0.5 * consts[0])


def test_merged_restores_the_layer_kept_list():
    (w, x), consts = _inputs()
    hoisted = hoist_invariant(_kept, (w, x), consts)
    kept = _kept((w, x), consts)
    varying = hoisted.varying(kept)
    assert len(varying) == 3                         # masked, scores, the callback's result
    for got, expected in zip(hoisted.merged(varying), kept):
        np.testing.assert_array_equal(got, expected)

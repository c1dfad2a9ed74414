"""The jaxpr facts `zeroxla.compat.jaxpr` states hold on the installed JAX: a scan equation's
consts / carries / xs counted as the `lax.scan` call made them (parameters on jax 0.10, flat
trees from 0.11: each CI leg runs its side of the branch), and every call primitive JAX makes
for `jax.jit`, `jax.checkpoint`, `jax.custom_jvp` and `jax.custom_vjp` found in the call table
with its jaxpr."""

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.compat import jaxpr as compat


def _scan_eqn(reverse):
    """The one scan equation of a `lax.scan` with 2 closed-over consts, 3 carries (each
    changed every step, so none is turned into a const) and 2 xs, over 5 steps."""
    def f(a, b, c0, c1, c2, x0, x1):
        def body(carry, xs):
            c0, c1, c2 = carry
            x0, x1 = xs
            return (c0 * a + x0, c1 + b * x1, c2 + c0.sum()), c0 + c1 * x0
        return lax.scan(body, (c0, c1, c2), (x0, x1), reverse=reverse)
    vec, rows = jnp.ones((3,)), jnp.ones((5, 3))
    closed = jax.make_jaxpr(f)(vec, vec, vec, vec, jnp.float32(0), rows, rows)
    (eqn,) = [e for e in closed.jaxpr.eqns if compat.is_scan(e)]
    return eqn


def test_scan_params_count_consts_carries_and_xs():
    for reverse in (False, True):
        eqn = _scan_eqn(reverse)
        p = compat.scan_params(eqn)
        assert (p.num_consts, p.num_carry, p.length, p.reverse) == (2, 3, 5, reverse)
        assert len(eqn.invars) == 2 + 3 + 2
        assert len(p.jaxpr.jaxpr.invars) == 2 + 3 + 2          # (consts, carries, xs)
        assert len(p.jaxpr.jaxpr.outvars) == len(eqn.outvars) == 3 + 1   # (carries, ys)


def test_every_call_jax_makes_is_in_the_call_table():
    @jax.custom_jvp
    def sin(x):
        return jnp.sin(x)
    sin.defjvp(lambda p, t: (sin(p[0]), jnp.cos(p[0]) * t[0]))

    @jax.custom_vjp
    def cos(x):
        return jnp.cos(x)
    cos.defvjp(lambda x: (cos(x), x), lambda x, g: (-jnp.sin(x) * g,))

    def f(x, w):
        y = jax.jit(lambda a: a * 2)(x)
        y = jax.checkpoint(lambda a: jnp.tanh(a @ w))(y)
        return sin(y) + cos(y)

    eqns = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((4, 4))).jaxpr.eqns
    calls = [e for e in eqns if compat.has_inner_jaxprs(e)]
    assert len(calls) == 4, [e.primitive.name for e in eqns]
    for eqn in calls:
        jaxpr, consts = compat.called_jaxpr(eqn)
        assert len(jaxpr.invars) == len(eqn.invars), eqn.primitive.name
        assert len(jaxpr.outvars) == len(eqn.outvars), eqn.primitive.name
    assert calls[0].primitive.name in compat.PLAIN_CALLS              # jax.jit's
    assert not any(e.primitive.name in compat.PLAIN_CALLS for e in calls[1:])
    assert all(compat.called_jaxpr(e) is None for e in eqns if not compat.has_inner_jaxprs(e))

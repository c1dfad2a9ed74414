"""models/grouped_matmul.py and models/moe.py against float64 numpy: every assignment's SwiGLU
expert (tiled and ragged_dot), its gradients, adversarial routings (every token to one expert;
experts with no token), the tile count against its bound, and the MoE layer's output against
a dense per-token sum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zeroxla import models
from zeroxla.models.grouped_matmul import expert_ffn, max_tiles, plan_tiles
from zeroxla.models.moe import MoeMLP, route

E, D, F, A = 8, 16, 12, 40


def weights(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((E, D, F)) * 0.3, rng.standard_normal((E, D, F)) * 0.3,
            rng.standard_normal((E, F, D)) * 0.3)


def reference(x, experts, wg, wu, wd):
    """float64: assignment a through expert experts[a]'s SwiGLU."""
    out = np.zeros((len(x), wd.shape[2]))
    for a, e in enumerate(experts):
        g, u = x[a] @ wg[e], x[a] @ wu[e]
        out[a] = (g / (1 + np.exp(-g)) * u) @ wd[e]
    return out


ROUTINGS = {
    "random": np.random.default_rng(1).integers(0, E, A),
    "all_to_one": np.full(A, 5),
    "half_the_experts_empty": np.random.default_rng(2).choice([0, 3, 6, 7], A),
    "one_each": np.arange(A) % E,
}


@pytest.mark.parametrize("implementation", ["tiled", "ragged_dot"])
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_expert_ffn_equals_float64(routing, implementation):
    experts = ROUTINGS[routing]
    x = np.random.default_rng(3).standard_normal((A, D))
    wg, wu, wd = weights()
    y, sizes, tiles = expert_ffn(jnp.asarray(x, jnp.float32),
                                 jnp.asarray(experts.reshape(-1, 1), jnp.int32),
                                 *(jnp.asarray(w, jnp.float32) for w in (wg, wu, wd)), tile=4,
                                 implementation=implementation)
    np.testing.assert_allclose(np.asarray(y)[:, 0], reference(x, experts, wg, wu, wd),
                               atol=2e-5)
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(experts, minlength=E))
    want_tiles = sum(-(-n // 4) for n in np.bincount(experts, minlength=E))
    assert int(tiles) == want_tiles <= max_tiles(A, E, 4)


@pytest.mark.parametrize("implementation", ["tiled", "ragged_dot"])
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_foreign_assignments_run_nothing_and_give_zero(routing, implementation):
    """Expert parallelism's view: the weights hold experts 4..7 only (as 0..3); an assignment
    to experts 0..3 is foreign (id 4 = one past the local experts): its output is zero, the
    rest equal float64, and the tiles run are the local groups' alone."""
    experts = ROUTINGS[routing]
    local = np.where(experts >= 4, experts - 4, 4)
    x = np.random.default_rng(3).standard_normal((A, D))
    wg, wu, wd = (w[4:] for w in weights())
    y, sizes, tiles = expert_ffn(jnp.asarray(x, jnp.float32),
                                 jnp.asarray(local.reshape(-1, 1), jnp.int32),
                                 *(jnp.asarray(w, jnp.float32) for w in (wg, wu, wd)), tile=4,
                                 implementation=implementation, skip_foreign=True)
    mine = experts >= 4
    want = np.zeros((A, D))
    want[mine] = reference(x[mine], local[mine], wg, wu, wd)
    np.testing.assert_allclose(np.asarray(y)[:, 0], want, atol=2e-5)
    counts = np.bincount(local[mine], minlength=4)
    np.testing.assert_array_equal(np.asarray(sizes), counts)
    assert int(tiles) == sum(-(-n // 4) for n in counts)


def _tiled_loss(x, wg, wu, wd, experts, cot):
    pairs = experts.reshape(-1, 2)           # each token two assignments: x's rows in pairs
    y = expert_ffn(x[::2], pairs, wg, wu, wd, tile=4, implementation="tiled")[0]
    return jnp.sum(y.reshape(A, D) * cot)


def _dense_loss(x, wg, wu, wd, experts, cot):
    x = jnp.repeat(x[::2], 2, axis=0)            # assignment a reads token a // 2
    g = jnp.einsum("ad,adf->af", x, wg[experts])
    u = jnp.einsum("ad,adf->af", x, wu[experts])
    return jnp.sum(jnp.einsum("af,afd->ad", jax.nn.silu(g) * u, wd[experts]) * cot)


# Gradients in x and the weights, one program per route for every routing (same shapes), not
# op by op.
_tiled_grads = jax.jit(jax.grad(_tiled_loss, argnums=(0, 1, 2, 3)))
_dense_grads = jax.jit(jax.grad(_dense_loss, argnums=(0, 1, 2, 3)))


@pytest.mark.parametrize("routing", ["random", "all_to_one", "half_the_experts_empty"])
def test_gradients_equal_the_dense_expansion(routing):
    """The custom VJP against autodiff of a plain per-assignment gather of the weights."""
    experts = jnp.asarray(ROUTINGS[routing], jnp.int32)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((A, D)), jnp.float32)
    ws = tuple(jnp.asarray(w, jnp.float32) for w in weights(5))
    cot = jnp.asarray(np.random.default_rng(6).standard_normal((A, D)), jnp.float32)

    got = _tiled_grads(x, *ws, experts, cot)
    want = _dense_grads(x, *ws, experts, cot)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=3e-5)


def test_tile_plan_rows_are_sorted_padded_groups():
    experts = jnp.asarray([2, 0, 2, 2, 1, 0], jnp.int32)
    plan = plan_tiles(experts, 3, tile=2)
    # Sorted: expert 0 (assignments 1, 5), 1 (4), 2 (0, 2, 3); groups padded to 2 rows.
    np.testing.assert_array_equal(np.asarray(plan.order), [1, 5, 4, 0, 2, 3])
    np.testing.assert_array_equal(np.asarray(plan.rows), [0, 1, 2, 4, 5, 6])
    assert int(plan.tiles_used) == 4
    np.testing.assert_array_equal(np.asarray(plan.tile_expert)[:4], [0, 1, 2, 2])


def test_moe_layer_equals_the_dense_per_token_sum():
    """Each token's output = sum over its top-k experts of weight x expert(token) (+ the
    shared expert's sigmoid-gated output), from float64 numpy of the same parameters."""
    cfg = models.Qwen2MoeConfig(d_model=D, num_experts=E, experts_per_token=3, expert_mlp_dim=F,
                                shared_expert_mlp_dim=10, norm_topk_prob=True, expert_tile=4,
                                num_heads=4, num_kv_heads=2)
    layer = MoeMLP(cfg, nnx.Rngs(0))
    h = np.random.default_rng(7).standard_normal((2, 5, D)).astype(np.float32)
    out, stats, chosen = layer(jnp.asarray(h))
    p = {k: np.asarray(v[...], np.float64) for k, v in nnx.to_flat_state(nnx.state(layer))
         for k in [k[-1]]}
    x = h.reshape(-1, D).astype(np.float64)
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :3]
    np.testing.assert_array_equal(np.asarray(chosen).reshape(-1, 3), top)
    w = np.take_along_axis(probs, top, -1)
    w /= w.sum(-1, keepdims=True)
    want = np.zeros_like(x)
    for n in range(len(x)):
        for j in range(3):
            want[n] += w[n, j] * reference(x[n:n + 1], [top[n, j]], p["w_gate"], p["w_up"],
                                           p["w_down"])[0]
        s_in = x[n] @ p["shared_gate"]
        inner = s_in / (1 + np.exp(-s_in)) * (x[n] @ p["shared_up"])
        want[n] += inner @ p["shared_down"] / (1 + np.exp(-(x[n] @ p["shared_expert_gate"])))
    np.testing.assert_allclose(np.asarray(out).reshape(-1, D), want, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(stats.counts), np.bincount(top.ravel(),
                                                                        minlength=E))
    np.testing.assert_allclose(np.asarray(stats.prob_sum), probs.sum(0), atol=1e-6)


def test_router_ties_go_to_the_lower_expert():
    router = jnp.zeros((D, E))                     # every probability equal
    _, experts, _ = route(jnp.ones((3, D)), router, 2, True)
    np.testing.assert_array_equal(np.asarray(experts), [[0, 1]] * 3)


def test_tiled_experts_stay_float64_in_a_float64_run():
    """A float64 run must not round through float32: the tiled grouped matmul accumulated in
    float32 whatever its inputs (1.2e-7 off float64 numpy), forward and weight gradients."""
    experts = ROUTINGS["random"]
    with jax.enable_x64(True):
        x = np.random.default_rng(3).standard_normal((A, D))
        wg, wu, wd = weights()

        def tiled(wg, x, assigned, wu, wd):
            return expert_ffn(x, assigned, wg, wu, wd, tile=4, implementation="tiled")[0][:, 0]

        @jax.jit                                                  # one program, not op by op
        def forward_and_vjp(wg, *rest):
            y, vjp = jax.vjp(lambda wg: tiled(wg, *rest), wg)
            return y, vjp(jnp.ones_like(y))[0]    # d sum(y) / d wg; analytic below

        assigned = jnp.asarray(experts.reshape(-1, 1), jnp.int32)
        y, d_wg = forward_and_vjp(jnp.asarray(wg), jnp.asarray(x), assigned, jnp.asarray(wu),
                                  jnp.asarray(wd))
        np.testing.assert_allclose(np.asarray(y), reference(x, experts, wg, wu, wd), atol=1e-12,
                                   rtol=0)
        g = np.einsum("ad,edf->aef", x, wg)[np.arange(A), experts]                 # [A, F]
        u = np.einsum("ad,edf->aef", x, wu)[np.arange(A), experts]
        sig = 1 / (1 + np.exp(-g))
        d_g = (wd[experts].sum(-1)) * u * sig * (1 + g * (1 - sig))                 # [A, F]
        want = np.zeros_like(wg)
        np.add.at(want, experts, x[:, :, None] * d_g[:, None, :])
        np.testing.assert_allclose(np.asarray(d_wg), want, atol=1e-12, rtol=0)

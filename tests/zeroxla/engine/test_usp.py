"""USP (`sequence_parallel_strategy="usp"`, `models.usp_attention`): Ulysses inside groups of
consecutive sequence devices, ring attention across the groups, inside the ZeRO-3 step.

References as in test_sequence_parallel.py: the same model trained unsharded on one device with
plain optax (float32, within 5e-6 of the largest gradient), the step without sequence
parallelism in float64 (within 1e-6), and the analytic volumes: all-to-all (T/P)(2H + 2G')K
(U-1)/U elements per device and layer each way, the ring's permutes `ring_elements` of the
group's T/R tokens for G'/U heads. U is the largest divisor of P that divides the heads:
Qwen2.5-0.5B's 14 heads at P = 8 give U = 2 and a ring of 4.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from reference import flat_params
from test_sequence_parallel import (FAMILIES, T, _assert_same_step, _batch, _factory,
                                    _local_rows, _sp_run, _step_collectives)
from zeroxla.models import Gemma2, Gemma2Config
from zeroxla.models.blockwise_attention import blocks_visited
from zeroxla.models.families import MistralConfig
from zeroxla.models.usp_attention import ulysses_degree, usp_elements

USP = zeroxla.ZeroConfig(stage=3, persistence_threshold=0, sequence_parallel_strategy="usp")
FAMILIES.update({   # 6 heads at P = 4: Ulysses over 2, a ring of 2, windows and soft-caps
    "mistral-6": (FAMILIES["mistral"][0], MistralConfig(
        init_std=0.2, d_model=48, num_heads=6, num_kv_heads=2, sliding_window=5)),
    "gemma2-6": (Gemma2, Gemma2Config(init_std=0.2, num_heads=6, num_kv_heads=2,
                                      sliding_window=5, attn_softcap=2.0)),
})


def test_the_ulysses_degree_is_the_largest_divisor_of_p_the_heads_allow():
    assert [ulysses_degree(14, p) for p in (2, 4, 8)] == [2, 2, 2]
    assert [ulysses_degree(8, p) for p in (2, 4, 8)] == [2, 4, 8]
    assert ulysses_degree(6, 4) == 2 and ulysses_degree(7, 8) == 1


SLOW = pytest.mark.slow      # the daily subset keeps one case of each kind


@pytest.mark.parametrize("family,degree,packed", [
    ("qwen2.5-0.5b-heads", 8, True),
    pytest.param("qwen2.5-0.5b-heads", 4, False, marks=SLOW),
    pytest.param("llama-6-3", 4, True, marks=SLOW),
    pytest.param("mistral-6", 4, True, marks=SLOW),
    pytest.param("gemma2-6", 4, False, marks=SLOW), pytest.param("llama", 8, True, marks=SLOW),
    pytest.param("gpt", 2, True, marks=SLOW)],
    ids=["0.5b-8-packed", "0.5b-4", "llama-6-3-4-packed", "mistral-6-4-packed", "gemma2-6-4",
         "llama-8-no-ring", "gpt-2-no-ring"])
def test_usp_trains_as_on_one_device(family, degree, packed):
    # U < P (a ring of groups; KV heads repeated where U does not divide them: 3 KV heads at
    # U = 2), U = P (Ulysses on the zigzag layout, no ring); windows, soft-caps, packed rows.
    _assert_same_step(family, degree, packed=packed, config=USP)


@SLOW
def test_float64_usp_at_eight_equals_the_step_without_sequence_parallelism():
    # 14 heads at P = 8: Ulysses over 2, a ring of 4; float64, so what is left is the
    # algorithm's.
    family = "qwen2.5-0.5b-heads"
    with jax.enable_x64(True):
        batch = _batch(8, packed=True)
        config = zeroxla.ZeroConfig(stage=3, persistence_threshold=0, compute_dtype="float64",
                                    sequence_parallel_strategy="usp")
        step = zeroxla.make_step(_factory(family, jnp.float64),
                                 zeroxla.make_mesh(1, 1, devices=jax.devices()[:1]),
                                 optimizer=optax.sgd(1.0), config=config)
        state, metrics = step(step.init(), batch)
        want = flat_params(nnx.state(step.gathered_model(state), nnx.Param))
        initial = flat_params(nnx.state(_factory(family, jnp.float64)(), nnx.Param))
        losses, got = _sp_run(family, 8, batch, config, dtype=jnp.float64)
    assert abs(losses[0] - float(metrics["loss"])) <= 1e-8 * abs(losses[0])
    scale = max(float(np.max(np.abs(want[p] - initial[p]))) for p in want)
    worst = max(float(np.max(np.abs(got[p] - want[p]))) for p in want)
    assert worst <= 1e-6 * scale, (worst, scale)


@SLOW      # each half's volume: test_sequence_parallel.py (Ulysses', the ring's)
def test_usp_moves_the_group_all_to_all_and_the_ring_volumes():
    # 14 heads, 2 KV heads at P = 8: all-to-alls in groups of 2 (q, k, v, out forward; their
    # gradients backward), permutes of the ring of 4; no activation all-gathered but the
    # groups' segment ids (none here: the batch is not packed).
    family, degree = "qwen2.5-0.5b-heads", 8
    cls, cfg = FAMILIES[family]
    found = _step_collectives(family, degree, USP)
    local_rows, head_dim, u = _local_rows(degree), cfg.d_model // cfg.num_heads, 2
    volumes = usp_elements(T, cfg.num_heads, cfg.num_kv_heads, head_dim, degree)
    to_all = [c for c in found if c.kind == "all-to-all"]
    sent = sum(c.operand_bytes * c.multiplier * (u - 1) // u for c in to_all)
    want = 2 * volumes["all_to_all"] * local_rows * 4 * cfg.num_layers
    assert want <= sent <= 1.05 * want, (sent, want)
    permuted = sum(c.operand_bytes * c.multiplier for c in found
                   if c.kind == "collective-permute")
    ring = sum(volumes[k] for k in ("ring_forward", "ring_backward", "ring_gradients"))
    assert permuted == ring * local_rows * 4 * cfg.num_layers, (permuted, ring)
    assert not [c for c in found if c.kind == "all-gather"
                and any(s.dims[:2] == (local_rows, T // degree) for s in c.operands)]




def test_the_ring_of_groups_balances_the_attention_blocks_of_every_device():
    # Qwen2.5-0.5B at T = 128K, P = 8 (U = 2, R = 4): each group's two ring chunks of 16,384
    # tokens against the keys, the same count on every ring position (and its U members).
    t, p, u = 131072, 8, 2
    r, c = p // u, t // (2 * p // u)
    work = [blocks_visited(c, t, j * c) + blocks_visited(c, t, (2 * r - 1 - j) * c)
            for j in range(r)]
    assert max(work) <= 1.05 * min(work), work


@SLOW      # the ring's lowering stays daily in test_sequence_parallel.py
def test_a_bf16_usp_step_lowers_for_cuda_with_grouped_all_to_alls_and_permutes():
    from zeroxla.compat.lowering import lower_for_cuda
    config = zeroxla.ZeroConfig(stage=3, persistence_threshold=0, compute_dtype="bfloat16",
                                sequence_parallel_strategy="usp")
    step = zeroxla.make_step(_factory("qwen2.5-0.5b-heads"), zeroxla.make_mesh(1, 1, sequence=8),
                             config=config)
    text = lower_for_cuda(step, step.init(), step._check_batch(_batch())).as_text()
    assert "stablehlo.all_to_all" in text and "stablehlo.collective_permute" in text


@SLOW
def test_hpz_and_qgz_with_usp_track_the_same_run_without_it():
    # 14 heads at P = 4 (Ulysses over 2, a ring of 2), packed rows. hpZ (its secondary
    # partition over the node's local x sequence devices) is exact: against one device within
    # the float32 tolerance. qgZ's int4 gradients are not exact: USP must land as near the
    # float32 reference as the same qgZ run without sequence parallelism (the same 2 replicas).
    from reference import train_single_device
    from test_sequence_parallel import FLOAT32_TOLERANCE, _masked_loss
    family = "qwen2.5-0.5b-heads"
    hpz = zeroxla.ZeroConfig(stage=3, persistence_threshold=0, hpz_partition_size=2,
                             sequence_parallel_strategy="usp")
    _assert_same_step(family, 4, packed=True, config=hpz)
    batch = _batch(5, packed=True)
    qgz = dict(stage=3, persistence_threshold=0, quantized_gradients=True,
               gradient_quantization_group_size=64)
    initial = flat_params(nnx.state(_factory(family)(), nnx.Param))
    _, want = train_single_device(_factory(family)(), optax.sgd(1.0), [batch],
                                  loss_fn=_masked_loss)
    _, with_usp = _sp_run(family, 4, batch, zeroxla.ZeroConfig(
        **qgz, hpz_partition_size=2, sequence_parallel_strategy="usp"))
    mesh = zeroxla.make_mesh(2, 1, devices=jax.devices()[:2])
    step = zeroxla.make_step(_factory(family), mesh,
                             optimizer=optax.sgd(1.0), config=zeroxla.ZeroConfig(**qgz))
    state, _ = step(step.init(), batch)
    without = flat_params(nnx.state(step.gathered_model(state), nnx.Param))

    def error(got):
        travelled = np.sqrt(sum(np.sum((want[p] - initial[p]) ** 2) for p in want))
        return np.sqrt(sum(np.sum((got[p] - want[p]) ** 2) for p in want)) / travelled
    assert 0 < error(with_usp) < 1.25 * error(without), (error(with_usp), error(without))
    assert FLOAT32_TOLERANCE < error(without)       # qgZ's noise, far above float32's

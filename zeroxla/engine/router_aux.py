"""A Mixture-of-Experts model's auxiliary load-balancing loss in the step, exactly as one device
computes it over the same tokens.

transformers' loss (`models.moe.aux_loss`) is E x sum_e f_e P_e with f_e and P_e means over every
token of the forward: not a sum of per-device terms. Each device holds sums over its own tokens
(`models.moe.RouterStats`); the step adds the counts and rows over the data devices (no
gradient flows through a count), and differentiates its own share

    local = E x sum_e counts_e(all devices) x prob_sum_e(this device) / rows(all devices)^2,

whose sum over the devices is the loss and whose gradients, summed by the gradient reduction,
are the loss's. Gradient accumulation computes it per micro-batch (over every device's part of
that micro-batch) and averages the micro-batches, as transformers' Trainer does with the same
`gradient_accumulation_steps`. The next-token loss is the one that adds it: a model whose
config sets a weight (`MoeLlamaConfig.aux_loss_weight`) with any other loss_fn is refused.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.engine.loss import MASK_KEY, POSITIONS_KEY, SEGMENT_IDS_KEY, Batch, masked_nll_terms

AUX_METRIC, LOAD_METRIC = "router/aux_loss", "router/load"


def aux_weight(model: Any) -> float:
    """The weight of `model`'s auxiliary loss in its training loss (0: none or not an MoE)."""
    return float(getattr(getattr(model, "config", None), "aux_loss_weight", 0.0) or 0.0)


def is_routed(model: Any) -> bool:
    """Whether `model` reports router statistics (`routed_token_logprobs`, `models.moe_llama`)
    and its config weighs them into the training loss. Read from the class and the config: a
    ZeRO-3 stand-in (`engine.wrap`) answers any attribute."""
    return (callable(getattr(type(model), "routed_token_logprobs", None))
            and aux_weight(model) > 0)


def check_loss_fn(model: Any, default_loss: bool) -> None:
    """ValueError when `model` weighs an auxiliary loss that a custom loss_fn would drop."""
    if is_routed(model) and not default_loss:
        c = model.config
        raise ValueError(
            f"{type(c).__name__} weighs the router's auxiliary load-balancing loss "
            f"(router_aux_loss_coef={c.router_aux_loss_coef}, output_router_logits="
            f"{c.output_router_logits}) but a custom loss_fn never sees it, so training would "
            "silently drop it; accepted: the default next-token loss, or a config with "
            "output_router_logits=False (transformers' rule: no auxiliary loss)")


def routed_loss_terms(model: Any, batch: Batch, sequence: Any = None):
    """`(sum, count, RouterStats)` of the next-token loss of `model` on `batch` (as
    `loss.next_token_loss_terms`) and its routers' statistics over the batch's tokens."""
    logp, stats = model.routed_token_logprobs(
        batch["inputs"], batch["targets"], positions=batch.get(POSITIONS_KEY),
        segment_ids=batch.get(SEGMENT_IDS_KEY), sequence=sequence)                # [B, T]
    total, count = masked_nll_terms(-logp, batch)
    return total, count, stats


def loss_count(batch: Batch) -> jax.Array:
    """The next-token loss's count of `batch` (its loss_mask's sum, else its tokens)."""
    if MASK_KEY in batch:
        return jnp.sum(batch[MASK_KEY].astype(jnp.float32))
    return jnp.float32(batch["targets"].size)


def aux_terms(stats, data_axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(this device's differentiable share of the loss, the loss (the same on every device),
    the per-expert load [E] = each expert's share of the assignments) from this device's
    `stats`; counts and rows summed over `data_axes`."""
    counts = lax.psum(lax.stop_gradient(stats.counts), data_axes)               # [E]
    rows = jnp.maximum(lax.psum(lax.stop_gradient(stats.rows), data_axes), 1e-9)
    experts = counts.shape[0]
    local = experts * jnp.sum(counts * stats.prob_sum) / rows ** 2
    total = lax.psum(lax.stop_gradient(local), data_axes)
    load = counts / jnp.maximum(jnp.sum(counts), 1e-9)
    return local.astype(jnp.float32), total.astype(jnp.float32), load.astype(jnp.float32)

"""A Mixture-of-Experts model's auxiliary load-balancing loss in the step, exactly as one device
computes it over the same tokens.

transformers' loss (`models.moe.aux_loss`) is E x sum_e f_e P_e with f_e and P_e means over every
token of the forward: not a sum of per-device terms. Each device holds sums over its own tokens
(`models.moe.RouterStats`); the step adds the counts and rows over the data devices (no
gradient flows through a count), and differentiates its own share

    local = E x sum_e counts_e(all devices) x prob_sum_e(this device) / rows(all devices)^2,

whose sum over the devices is the loss and whose gradients, summed by the gradient reduction,
are the loss's.

With k micro-batches (gradient accumulation) it is the mean over i of the loss of micro-batch i:
the i-th of k equal pieces of every data replica's rows, taken together (replica r of R holds
rows [r B / R, (r + 1) B / R) of the global batch). So with the loss weighed, the update
depends on k and R (and on the rows' order), where the cross-entropy's is the whole batch's
mean for any k and R; at k = 1 it is the whole batch's for any R. Each term is transformers'
per-forward loss over those rows (`load_balancing_loss_func`); transformers 5.23's Trainer adds
each forward's term unscaled (its MoE models normalise their loss by `num_items_in_batch`),
i.e. sums rather than averages them over micro-batches. Statistics over the whole global batch
(Qwen's global-batch balancing) would need every micro-batch's routing counts before the first
backward: a second forward of the model per step.

The default next-token loss has the statistics; a loss_fn
returns them as a third value, `(sum, count, stats)` (`routed_token_logprobs` gives them beside the
log-probs; the RL losses do); a model whose config weighs the loss
(`MoeLlamaConfig.aux_loss_weight`) under a loss_fn that returns none is refused. Statistics
returned are logged (`router/aux_loss`, `router/load`) whatever the weight.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.engine.loss import (MASK_KEY, POSITIONS_KEY, SEGMENT_IDS_KEY, Batch,
                                 masked_nll_terms, model_token_logprobs)
from zeroxla.models.axes import EXPERTS
from zeroxla.models.moe import RouterStats

AUX_METRIC, LOAD_METRIC = "router/aux_loss", "router/load"


def aux_weight(model: Any) -> float:
    """The weight of `model`'s auxiliary loss in its training loss (0: none or not an MoE)."""
    return float(getattr(getattr(model, "config", None), "aux_loss_weight", 0.0) or 0.0)


def has_router(model: Any) -> bool:
    """Whether `model` reports router statistics (`routed_token_logprobs`, `models.moe_llama`).
    Read from the class: a ZeRO-3 stand-in (`engine.wrap`) answers any attribute."""
    return callable(getattr(type(model), "routed_token_logprobs", None))


def routed_token_logprobs(model: Any, tokens: jax.Array, labels: jax.Array,
                          **options: Any):
    """`(loss.model_token_logprobs(model, tokens, labels, **options), RouterStats or None)`:
    the statistics where the model has a router. What a loss_fn calls to return them as its
    third value (`(sum, count, stats)`), so the step adds the auxiliary loss and logs the
    per-expert load (the RL losses do). Its own name: `loss.token_logprobs` takes logits."""
    if not has_router(model):
        return model_token_logprobs(model, tokens, labels, **options), None
    return model.routed_token_logprobs(tokens, labels, **options)


def split_stats(value: Any) -> tuple[Any, Any]:
    """A loss_fn's value without its router statistics, and them (None when it returned
    none): `(sum, count, stats)` -> `((sum, count), stats)`."""
    if isinstance(value, (tuple, list)) and len(value) == 3 and isinstance(value[2],
                                                                          RouterStats):
        return tuple(value[:2]), value[2]
    return value, None


def check_stats(model: Any, stats: Any) -> None:
    """ValueError when `model` weighs an auxiliary loss but its loss_fn returned no router
    statistics: training would silently drop it."""
    if stats is None and has_router(model) and aux_weight(model) > 0:
        c = model.config
        raise ValueError(
            f"{type(c).__name__} weighs the router's auxiliary load-balancing loss "
            f"(router_aux_loss_coef={c.router_aux_loss_coef}, output_router_logits="
            f"{c.output_router_logits}) but the loss_fn returned no router statistics, so "
            "training would silently drop it; accepted: the default next-token loss, a loss_fn "
            "returning (sum, count, stats) with stats from "
            "zeroxla.engine.router_aux.routed_token_logprobs, or a config with "
            "output_router_logits=False (transformers' rule: no auxiliary loss)")


def check_accumulation(default_loss: bool, micro_batches: int, weight: float) -> None:
    """ValueError for a loss_fn of its own returning statistics under gradient accumulation:
    its loss's count over the whole step, which scales each micro-batch's share of the
    auxiliary loss, is known only after the last micro-batch."""
    if not default_loss and micro_batches > 1 and weight > 0:
        raise ValueError(
            f"gradient_accumulation_steps={micro_batches} with a loss_fn of its own returning "
            "router statistics: each micro-batch's share of the auxiliary loss is scaled by "
            "the loss's count over the whole step, known only after the last micro-batch; "
            "accepted: gradient_accumulation_steps=1, the default next-token loss, or "
            "output_router_logits=False")


def check_budget_with_router(model: Any, budget: str, without: str, actor: str) -> None:
    """ValueError, when `model` weighs its auxiliary loss, for a token budget (verl's
    `ppo_max_token_len_per_gpu`): it makes each data replica's packed rows micro-batches, which
    `check_accumulation` refuses for the RL losses (their own loss_fn) at the first step, after
    a rollout. Called when a trainer (or a job) is built, in its own words: `budget` the budget
    as set ("--ppo-max-token-len-per-gpu 64"), `without` how to leave it out, `actor` the model."""
    if has_router(model) and aux_weight(model) > 0:
        c = model.config
        raise ValueError(
            f"{budget} on {actor}, whose {type(c).__name__} weighs the router's auxiliary "
            f"load-balancing loss (router_aux_loss_coef={c.router_aux_loss_coef}, "
            f"output_router_logits={c.output_router_logits}): the budget makes each data "
            "replica's packed rows micro-batches whose gradients are accumulated, and a "
            "micro-batch's share of the auxiliary loss is scaled by the RL loss's count over "
            "the whole step, known only after the last micro-batch; accepted: "
            f"{without} (every row in one micro-batch), or an actor whose config has "
            "output_router_logits=False (no auxiliary loss)")


def no_metrics(model_def: Any) -> tuple[jax.Array, jax.Array]:
    """What a micro-batch logs of the router when it returned no statistics: (0, zeros [E]),
    E the model's expert count (its first dim named `experts`; 0 for a dense model), so that
    gradient accumulation's carry has one shape."""
    names, shapes = model_def.axes_dict(), model_def.shape_dict()
    experts = next((shapes[p][names[p].index(EXPERTS)] for p in shapes
                    if names.get(p) and EXPERTS in names[p]), 0)
    return jnp.float32(0), jnp.zeros((experts,), jnp.float32)


def objective_term(stats, weight: float, data_axes: tuple[str, ...], default_loss: bool,
                   micro_batches: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """(this device's differentiable share of weight x the auxiliary loss, per micro-batch;
    what it logs: (the loss, the per-expert load), each over the micro-batch count) from its
    `stats`. The step multiplies the share by its count over the whole step (`loss_count`)."""
    check_accumulation(default_loss, micro_batches, weight)
    local, aux, load = aux_terms(stats, data_axes)
    return local * (weight / micro_batches), (aux / micro_batches, load / micro_batches)


class AuxPass:
    """One gradient pass's auxiliary loss, as the step's objective adds it
    (`engine.objective`): each micro-batch's weighed share added to the value the step
    differentiates, scaled by the loss's count over the whole step (`step_count`, the default
    loss's; else the micro-batch's own count summed over `data_axes`, which
    `check_accumulation` requires to be the step's) so that the step's final division by that
    count leaves it as itself; and what the pass logs, `zeros` for a micro-batch whose loss
    returned no statistics (one carry shape under gradient accumulation)."""

    def __init__(self, weight: float, data_axes: tuple[str, ...], default_loss: bool,
                 micro_batches: int, step_count: jax.Array | None,
                 zeros: tuple[jax.Array, jax.Array]):
        self.weight, self.data_axes, self.default_loss = weight, data_axes, default_loss
        self.micro_batches, self.step_count, self.zeros = micro_batches, step_count, zeros
        self._weights: list[float] = []      # the term's weight, once a loss returned stats

    def add(self, value: jax.Array, stats: Any, count: jax.Array, scale: jax.Array,
            c0: float) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """(`value` (the loss sum x scale / c0) plus this micro-batch's share of the weighed
        auxiliary loss in the same units, what it logs) from its `stats` (None: nothing)."""
        if stats is None:
            return value, self.zeros
        self._weights.append(self.weight)
        whole = (self.step_count if self.micro_batches > 1
                 else lax.psum(lax.stop_gradient(count), self.data_axes))
        term, logged = objective_term(stats, self.weight, self.data_axes, self.default_loss,
                                      self.micro_batches)
        return value + term * (scale * whole / c0), logged

    def metrics(self, loss: jax.Array, logged) -> dict[str, jax.Array]:
        """The pass's loss metrics from the mean `loss` and the micro-batches' `logged`."""
        return losses(loss, self._weights, logged)


def losses(loss: jax.Array, weights: list[float], logged) -> dict[str, jax.Array]:
    """The step's loss metrics: the loss (plus weight x the auxiliary loss, and the router's
    metrics, when the loss returned router statistics: `weights` holds their weight)."""
    if not weights:
        return {"loss": loss}
    return {"loss": loss + weights[0] * logged[0], AUX_METRIC: logged[0],
            LOAD_METRIC: logged[1]}


def routed_loss_terms(model: Any, batch: Batch, sequence: Any = None, experts: Any = None):
    """`(sum, count, RouterStats)` of the next-token loss of `model` on `batch` (as
    `loss.next_token_loss_terms`) and its routers' statistics over the batch's tokens;
    `experts` (an `ExpertParallel`) passed to the model only when given."""
    options = {} if experts is None else {"experts": experts}
    logp, stats = model.routed_token_logprobs(
        batch["inputs"], batch["targets"], positions=batch.get(POSITIONS_KEY),
        segment_ids=batch.get(SEGMENT_IDS_KEY), sequence=sequence, **options)     # [B, T]
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


def router_record(metrics: dict[str, Any]) -> dict[str, Any]:
    """The router's entries of a step's metrics as a metrics.jsonl record's: `router/aux_loss`
    a float, `router/load` a list of each expert's share (none for a dense model)."""
    if LOAD_METRIC not in metrics:
        return {}
    return {AUX_METRIC: float(metrics[AUX_METRIC]),
            LOAD_METRIC: [round(float(x), 6) for x in metrics[LOAD_METRIC]]}

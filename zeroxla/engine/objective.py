"""The step's objective, one forward at a time: the loss as a sum and a count, and the opt-in
terms added to it, handed to the step as one object, so that the step differentiates and logs
whatever a loss returns without asking the model what it is.

    objective = Objective(layout)                     # once, when the step is built
    terms = objective.terms(model, batch, key)        # Terms(total, count, is_sum, stats)
    extra = objective.extra(batch, k)                 # one gradient pass's opt-in terms
    value, logged = extra.add(value, terms.stats, terms.count, scale, c0)
    metrics = extra.metrics(loss, logged)

The loss is the layout's loss_fn as `(sum, count)` (`loss.loss_terms`): the default next-token
loss, or a loss_fn of its own, called with `sequence=` and `experts=` (the model's sequence and
expert layouts, `engine.sequence`, `engine.experts`) and `rngs=` where it declares them.

The one opt-in term is an MoE model's auxiliary load-balancing loss (`router_aux`): the default
loss returns the router statistics of a model with a router (read from the model's class once,
here), a loss_fn of its own returns them as a third value `(sum, count, stats)`; the model's
config weighs the term (`aux_loss_weight`). A loss that returns no statistics adds nothing and
logs no router metrics.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from flax import nnx
from jax import lax

from zeroxla.engine import router_aux
from zeroxla.engine.loss import Batch, loss_terms, next_token_loss, next_token_loss_terms
from zeroxla.engine.randomness import CALL_STREAM


class Terms(NamedTuple):
    """One forward's loss over this device's batch piece: `total` and `count` its sum and
    count, `is_sum` False for a loss_fn that returned a scalar mean (its count is 1), `stats`
    the router statistics it returned (`models.moe.RouterStats`), or None."""

    total: jax.Array
    count: jax.Array
    is_sum: bool
    stats: Any


class Objective:
    """The loss of a step's layout (`ZeroLayout`) and its opt-in terms (module docstring)."""

    def __init__(self, layout: Any):
        self.layout = layout
        self._model = layout.model_def.abstract_module()     # its class and config, no values
        self._routed = router_aux.has_router(self._model)
        self._weight = router_aux.aux_weight(self._model)

    def terms(self, model: Any, batch: Batch, key: jax.Array | None) -> Terms:
        """The loss of `model` (this device's copy) on `batch`; a loss_fn declaring `rngs` gets
        `nnx.Rngs` seeded from `key`."""
        layout = self.layout
        sequence, experts = layout.sequence, layout.experts
        if layout.loss_fn is next_token_loss:
            if self._routed:
                total, count, stats = router_aux.routed_loss_terms(model, batch, sequence,
                                                                   experts)
                return Terms(total, count, True, stats)
            return Terms(*next_token_loss_terms(model, batch, sequence, experts), True, None)
        options: dict[str, Any] = {name: value for name, value in (
            ("sequence", sequence), ("experts", experts)) if value is not None}
        if layout.loss_takes_rngs:
            options["rngs"] = nnx.Rngs(jax.random.fold_in(key, CALL_STREAM))
        value, stats = router_aux.split_stats(layout.loss_fn(model, batch, **options))
        router_aux.check_stats(self._model, stats)
        return Terms(*loss_terms(value, "loss_fn"), isinstance(value, (tuple, list)), stats)

    def extra(self, batch: Batch, micro_batches: int) -> router_aux.AuxPass:
        """The opt-in terms of one gradient pass over the global `batch` (this device's rows)
        in `micro_batches` pieces."""
        data = self.layout.axes.data
        default_loss = self.layout.loss_fn is next_token_loss
        step_count = lax.psum(router_aux.loss_count(batch), data) if default_loss else None
        return router_aux.AuxPass(self._weight, data, default_loss, micro_batches, step_count,
                                  router_aux.no_metrics(self.layout.model_def))

    def eval_loss(self, loss: jax.Array, terms: Terms) -> jax.Array:
        """Evaluation's loss: the global mean `loss` plus the weighed auxiliary loss when the
        forward returned router statistics."""
        if terms.stats is None:
            return loss
        return loss + self._weight * router_aux.aux_terms(terms.stats,
                                                          self.layout.axes.data)[1]


__all__ = ["Objective", "Terms"]

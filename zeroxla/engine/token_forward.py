"""Per-token values of a batch (log-probs, a critic's values) computed in a step's own layout.

An RL trainer reads its policy before it trains it: the rollout's log-probs under the policy
that drew it (the ratio's "old" side), a critic's values. Run on a gathered copy, that forward
holds the whole model and every token of the rollout on one device, so at reasoning-trace
lengths it is the first thing to run out of memory, and under sequence parallelism it would be
the only part of the job that is not split. `TokenForward(step, fn)` runs `fn` where the step
trains: inside the step's `shard_map` (ZeRO-3's per-layer gathers; rows over the data
replicas; under sequence parallelism each row's tokens over the sequence devices, the model
told so, `sequence=`; under expert parallelism the MoE layers' experts split as the step splits
them, the model told so, `experts=`), in evaluation mode, and returns the values [B, T] of the
global batch in its own token order (`out_of_sequence_layout` undoes the zigzag split).

    forward = TokenForward(step, fn)   # fn(model, batch, *, sequence=None, experts=None) -> [B, T]
    values = forward(state, batch)          # float32 [B, T], replicated

`fn` may return a tuple of per-token arrays [B, T] (routing replay's log-probs and per-token
mismatch counts, `rlhf.answer_values`): each comes back in the same layout, floating ones as
float32, integer ones as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroxla.compat.cache import check_persistent_cache
from zeroxla.engine.batch_checks import check_batch
from zeroxla.engine.consumption import proven_call
from zeroxla.engine.experts import takes_experts
from zeroxla.engine.sequence import (batch_spec, check_sequence_batch, in_sequence_layout,
                                     out_of_sequence_layout, takes_sequence)
from zeroxla.engine.wrap import local_model


class TokenForward:
    """`forward(state, batch) -> float32 [B, T]`: `fn(model, batch)` of the state's model on
    the global `batch` (a dict of [B, T, ...] arrays; B a multiple of the data replicas, T of
    the chunks sequence parallelism cuts a row into), in `step`'s layout (module docstring).
    `fn` must declare `sequence` when the step's mesh has a sequence axis (it gets this
    device's slice of every row and must pass `sequence=` to the model), and `experts` when
    the step splits the model's experts over an expert axis (it must pass `experts=` to the
    model), else it is refused here, by name."""

    def __init__(self, step: Any, fn: Callable[..., jax.Array]):
        layout = self.layout = step.layout
        for arg, split, takes, what, why in (
                ("sequence", layout.sequence, takes_sequence, "every sequence",
                 "it would run the model on a slice as if it were whole sequences"),
                ("experts", layout.experts, takes_experts, "the model's experts",
                 "its MoE layers would refuse a call without it")):
            if split is not None and not takes(fn):
                name = getattr(fn, "__name__", type(fn).__name__)
                raise ValueError(
                    f"TokenForward: the step's mesh splits {what} over {split.size} devices, "
                    f"but fn {name} takes no `{arg}` argument: {why}; accepted: fn(model, "
                    f"batch, *, {arg}) passing `{arg}` to the model")
        self.fn, spec = fn, batch_spec(layout.axes)
        local = jax.shard_map(self._local, mesh=layout.mesh,
                              in_specs=(layout.model_plan.compute_input_specs(), P(), spec),
                              out_specs=spec, check_vma=False)

        def run(params, model_state, batch):
            # The model proven to use sequence= and the packing keys (`engine.consumption`).
            values = proven_call(local, (layout.eval_inputs(params), model_state,
                                         in_sequence_layout(batch, layout.sequence)),
                                 layout, batch_at=2, loss_fn=fn)
            return jax.tree.map(lambda v: out_of_sequence_layout(v, layout.sequence),
                                values)                                   # [B, T] each

        self._jitted = jax.jit(run, out_shardings=NamedSharding(layout.mesh, P()))

    def _local(self, params: dict[str, Any], model_state: dict[str, Any],
               batch: dict[str, jax.Array]) -> jax.Array:
        key = jax.random.key(0) if self.layout.uses_rng else None   # evaluation draws nothing
        model, _ = local_model(self.layout, params, model_state, key, training=False)
        options = {name: value for name, value in (
            ("sequence", self.layout.sequence), ("experts", self.layout.experts))
            if value is not None}
        return jax.tree.map(_float32, self.fn(model, batch, **options))   # [B/R, T/P] each

    def __call__(self, state: Any, batch: dict[str, Any]) -> jax.Array:
        check_persistent_cache(self.layout.mesh.devices.flat)    # zeroxla.compat.cache
        return self._jitted(state.params, state.model_state, self._checked(batch))

    def lower(self, state: Any, batch: dict[str, Any]) -> jax.stages.Lowered:
        """The program `__call__` runs on `state` and `batch`, lowered: `.compile()` gives
        its `memory_analysis()` and `input_shardings` (what the per-device memory checks
        read)."""
        return self._jitted.lower(state.params, state.model_state, self._checked(batch))

    def _checked(self, batch: dict[str, Any]) -> dict[str, Any]:
        layout = self.layout
        checked = check_batch(batch, next_token=False, data_size=layout.data_size,
                              accumulation=1, vocab_size=lambda: layout.vocab_size)
        if layout.sequence is not None:
            check_sequence_batch(checked, layout.sequence)
        return checked


def fill_rows(rows: np.ndarray, count: int) -> np.ndarray:
    """`rows` [B, ...] followed by copies of its last row up to `count` rows (B <= count): a batch
    filled out to a multiple of the data replicas a `TokenForward` splits it over; the copies'
    values are the caller's to drop."""
    return np.concatenate([rows, np.repeat(rows[-1:], count - len(rows), 0)])


def _float32(values: jax.Array) -> jax.Array:
    """A floating output as float32; an integer one (a count) as it is."""
    return values if jnp.issubdtype(values.dtype, jnp.integer) else values.astype(jnp.float32)


__all__ = ["TokenForward", "fill_rows"]

"""The rollout-side configuration fields GRPO and PPO share, and their one check.

Both trainers draw their rollouts through the same engine and the same asynchronous pipeline,
so the same fields mean the same thing in `GRPOConfig` and `PPOConfig`: `routing_replay` (an MoE
actor's routing replay, R3: `roles.resolve_routing_replay`), `rollout_dtype`, `batch_invariant`,
and the split mesh's `rollout_devices` / `max_staleness` (`async_rollouts`). Each check reports
through the caller's `check(name, value, ok, accepted)`, so the error names the caller's config
class and field (or, in a job, its option)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zeroxla.inference.config import ROLLOUT_DTYPES

# "auto": "on" for an MoE actor, "off" for a dense one (resolved when the actor is built).
ROUTING_REPLAY = ("auto", "off", "measure", "on")

Check = Callable[[str, Any, bool, str], None]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

def check_rollout_fields(config: Any, check: Check) -> None:
    """The rollout-side fields (`routing_replay`, `rollout_dtype`, `batch_invariant`), each
    through `check(name, value, ok, accepted)`: the config's own error, naming its class and
    the field."""
    check("routing_replay", config.routing_replay, config.routing_replay in ROUTING_REPLAY and (
        config.packing or config.routing_replay in ("auto", "off")),
        " | ".join(ROUTING_REPLAY) + " (measure and on with packing=True: the replayed "
        "forward is the packed one)")
    check("rollout_dtype", config.rollout_dtype, config.rollout_dtype in ROLLOUT_DTYPES,
          " | ".join(ROLLOUT_DTYPES))
    check("batch_invariant", config.batch_invariant, isinstance(config.batch_invariant, bool)
          and not (config.batch_invariant and config.rollout_dtype != "float32"),
          "True or False; True with rollout_dtype='float32' (the mode computes in float32, as "
          "the training forward does)")


def check_async_fields(config: Any, check: Check) -> None:
    """The asynchronous pipeline's fields (`rollout_devices`, `max_staleness`:
    `zeroxla.rlhf.async_rollouts`), each through `check` as `check_rollout_fields`'s."""
    for name in ("rollout_devices", "max_staleness"):
        value = getattr(config, name)
        check(name, value, _is_int(value) and value >= 0, "an integer >= 0")
    check("max_staleness", config.max_staleness, not config.max_staleness
          or config.rollout_devices > 0, "0 with rollout_devices=0 (colocated rollouts "
          "wait for the update); > 0 with rollout_devices > 0")


__all__ = ["ROUTING_REPLAY", "check_async_fields", "check_rollout_fields"]

"""The asynchronous pipeline GRPO and PPO share: the mesh split into a training group and a
rollout group (`split_mesh`), and the rollouts drawn ahead on the rollout group while the
training group updates (`AsyncRollouts`), from whatever draws them (`RolloutSide`: GRPO's and
PPO's trainers).

`rollout_devices` N > 0 (`GRPOConfig`, `PPOConfig`) splits the mesh: the training group (the
actor's ZeRO-3 step, its old and reference log-probs, PPO's critic) on the first devices, a
rollout group (`zeroxla.inference.rollout_group.RolloutGroup`: the Hybrid Engine, tensor
parallel) on the last N. Versions count updates: version v is the actor after v iterations'
updates (the actor at iteration i, before its update, is version i). With `max_staleness` k,
iteration i's rollout is drawn from version v_i = max(s, i - k), s the pipeline's first
iteration: the newest synced version when it is launched, since the rollout of i + k is
launched while update i runs, from version i, synced (one transfer) before update i was
dispatched.

One iteration i (`GRPOTrainer.iteration`, `PPOTrainer.iteration`):
1. `take(i)`: sync version i into the group (the actor is version i: update i - 1 was read);
   rollout i, unless drawn ahead (k = 0: never), is drawn now, from version i;
2. the training group computes what it reads of the answers at version i (the synchronous
   loop's old and reference log-probs; PPO's values, rewards and GAE), then dispatches update
   i; `launch_ahead(i)` then draws the rollouts up to i + k from version i, on the group,
   before anything of update i is read (jax's asynchronous dispatch runs the two groups'
   programs side by side);
3. update i is read (its loss), and its record gets `policy_version`, `staleness` and the
   sync's `sync/bytes` against `sync/floor_bytes` (one copy of the trainable weights).

k = 0 is the synchronous loop's order exactly (sync i, draw i, update i), on the group's
devices. `events` lists ("dispatch" | "read", "rollout" | "update", iteration) as the host
issues them: a rollout is read when its answers come back (the engine's loop is host-driven),
an update when its loss is.

With `partial_rollout` N (GRPO's; `pass_tokens`), every launch draws one pass
(`partial_rollout`): a rollout drawn ahead gets at most N new tokens per answer at each launch,
and `take(i)` continues its unfinished answers to their end from version i, so a carried
answer's tokens hold the versions that drew them (its first pass's and i), each one's engine
log-prob the pi_behav of the decoupled objective (`GRPOConfig.rollout_correction="decoupled"`).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from zeroxla.engine.state import TrainState
from zeroxla.inference.rollout_group import RolloutGroup
from zeroxla.rlhf.partial_rollout import PartialAnswers
from zeroxla.sharding.mesh import LOCAL_AXIS, NODE_AXIS, make_mesh


def split_mesh(mesh: Any, rollout_devices: int, lora: Any = None, owner: str = "GRPOConfig"
               ) -> tuple[Any, Any]:
    """(training mesh, rollout mesh): the first and last `rollout_devices` devices of `mesh`,
    each `(node=1, local=N)`; (`mesh`, None) for 0 (colocated). ValueError naming
    `<owner>.rollout_devices` (the config asking) unless N is half the devices (the rollout
    group stores the parameters as the training group does: `RolloutGroup`), and with what
    this slice does not support: sequence or expert parallelism (a mesh axis), enabled LoRA
    adapters (`lora`)."""
    if not rollout_devices:
        return mesh, None
    field = f"{owner}.rollout_devices={rollout_devices}"
    other = [name for name in mesh.axis_names if name not in (NODE_AXIS, LOCAL_AXIS)
             and mesh.shape[name] > 1]
    if other:
        raise ValueError(f"{field} on a mesh with {', '.join(other)} axes: asynchronous "
                         "rollouts are not supported with sequence or expert parallelism; "
                         "accepted: rollout_devices=0 (colocated), or a mesh of node and "
                         "local axes alone")
    if lora is not None and lora.enabled:
        raise ValueError(f"{field} with LoRA adapters: asynchronous rollouts are not "
                         "supported with LoRA; accepted: rollout_devices=0 (colocated)")
    devices = list(np.asarray(mesh.devices).flat)
    if 2 * rollout_devices != len(devices):
        raise ValueError(f"{field} on {len(devices)} devices; accepted: 0 (colocated) or "
                         f"{len(devices) // 2} (half: the rollout group stores the parameters "
                         "as the training group does)")
    half = len(devices) // 2
    return (make_mesh(1, half, devices=devices[:half]),
            make_mesh(1, half, devices=devices[half:]))


class Drawn(Protocol):
    """A finished rollout as the record reads it: the oldest version among its tokens', and
    each token's version int32[B, T] (-1 past an answer; None outside the pipeline)."""

    version: int | None
    versions: np.ndarray | None


class RolloutSide(Protocol):
    """What draws a rollout from the group's state (`GRPOTrainer`, `PPOTrainer`): a first pass
    of rollout `iteration`, later passes over its unfinished answers, and the finished answers
    as the trainer's rollout data (`Drawn`: GRPO's scored `DrawnRollout`, PPO's `DrawnAnswers`);
    `tokens` caps each pass's new tokens per answer (None: to the end)."""

    def start(self, iteration: int, version: int | None, tokens: int | None
              ) -> PartialAnswers: ...

    def advance(self, partial: PartialAnswers, version: int | None, tokens: int | None
                ) -> None: ...

    def finish(self, partial: PartialAnswers) -> Drawn: ...


class AsyncRollouts:
    """The rollouts drawn ahead on `group` with at most `max_staleness` versions of lag (see
    the module docstring) by `side` from `group.state`; `pass_tokens`: a pass's new tokens
    per answer for a rollout drawn ahead (None: whole answers)."""

    def __init__(self, group: RolloutGroup, max_staleness: int, side: RolloutSide,
                 pass_tokens: int | None = None):
        self.group, self.max_staleness, self.side = group, max_staleness, side
        self.pass_tokens = pass_tokens
        self.version: int | None = None         # the version `group.state` holds
        self.ahead: dict[int, PartialAnswers] = {}
        self.events: list[tuple[str, str, int]] = []

    def _pass(self, iteration: int, tokens: int | None) -> None:
        """Rollout `iteration` started, or its unfinished answers continued, from the group's
        version; nothing when every answer is finished."""
        partial = self.ahead.get(iteration)
        if partial is not None and not partial.pending():
            return
        self.events.append(("dispatch", "rollout", iteration))
        if partial is None:
            self.ahead[iteration] = self.side.start(iteration, self.version, tokens)
        else:
            self.side.advance(partial, self.version, tokens)
        self.events.append(("read", "rollout", iteration))

    def sync(self, state: TrainState, version: int | None) -> None:
        """`state` (version `version`; None: not a pipeline version, e.g. for evaluation) into
        the group, unless it holds that version already."""
        if version is None or version != self.version:
            self.group.sync(state)
            self.version = version

    def take(self, iteration: int, state: TrainState) -> Drawn:
        """Iteration `iteration`'s rollout; `state` is the actor at version `iteration`."""
        self.sync(state, iteration)
        self._pass(iteration, None)     # drawn now, or its carried answers finished
        return self.side.finish(self.ahead.pop(iteration))

    def launch_ahead(self, iteration: int) -> None:
        """Called once update `iteration` is dispatched, before it is read: a pass of each
        rollout up to `iteration + max_staleness`, from the version the group holds
        (`iteration`)."""
        self.events.append(("dispatch", "update", iteration))
        for later in range(iteration + 1, iteration + self.max_staleness + 1):
            self._pass(later, self.pass_tokens)

    def record(self, iteration: int, drawn: Drawn) -> dict[str, float]:
        """Update `iteration` read: its record's pipeline entries."""
        self.events.append(("read", "update", iteration))
        record = {"policy_version": drawn.version, "staleness": iteration - drawn.version,
                  "sync/bytes": float(self.group.bytes_moved),
                  "sync/floor_bytes": float(self.group.floor_bytes)}
        if self.pass_tokens is not None:        # answers drawn by more than one version
            record["partial/carried"] = int(sum(np.unique(v[v >= 0]).size > 1
                                                for v in drawn.versions))
        return record


__all__ = ["AsyncRollouts", "Drawn", "RolloutSide", "split_mesh"]

"""What one schedule step's op changes in the pipeline's carry, and how it is written in.

A step picks its op (idle, forward, backward, weight-gradient pass) with `lax.switch`. The
stash arrays ([buffers, ...]: each buffer's activations or residuals, ZB-H1's weight-pass
stash) go into the switch read-only, and the op returns a `StepUpdate`: the one buffer it
fills, the gradients it adds, the results it sends. A branch that returned the stash arrays
themselves would make XLA copy each through the conditional where two ops share the step
(1F1B's F and B; a conditional's outputs then do not share its operands' buffers): two whole
stashes at every step boundary and a whole stash's copy per step. gpt-small, 4 stages
(`benchmarks/pipeline.py`), compiled temporaries with one buffer returned: 71.3 MiB for 1F1B
and 80.3 MiB for ZB-H1, flat in M; with whole stashes returned they measured 107.6 and
127-140 MiB, growing with M.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

f32 = jnp.float32


def gradient_sum(*parts: dict[str, Any]) -> dict[str, Any]:
    """The float32 sum, path by path, of gradient dicts that each cover some paths (None
    entries skipped): what one op adds to the step's gradient sums."""
    total: dict[str, Any] = {}
    for part in parts:
        for path, d in part.items():
            if d is not None:
                total[path] = total[path] + d.astype(f32) if path in total else d.astype(f32)
    return total


def add_gradients(sums: dict[str, Any], grads: dict[str, Any]) -> dict[str, Any]:
    """The float32 gradient sums `sums` (every trainable path) plus `grads` (some paths)."""
    if not set(grads) <= set(sums):
        raise AssertionError(f"gradients of {sorted(set(grads) - set(sums))} have no sum: "
                             "they are not trainable leaves of this stage")
    return {path: g + grads[path].astype(f32) if path in grads else g
            for path, g in sums.items()}


@dataclasses.dataclass(frozen=True)
class StepUpdate:
    """What one op of a step changes, as values rather than as a new carry.

    `slots` holds one buffer's value per stash entry the op fills; `StagePasses.apply`
    writes it in at the op's buffer, in place, after the switch (module docstring), and adds
    `grads` to the float32 sums. (Where a step's only other branch idles, the branch writes
    its buffer itself and returns the stash entry whole: XLA then shares the idle branch's
    pass-through buffer with the write, and no buffer's value is held twice.)
    """

    slots: dict[str, Any] = dataclasses.field(default_factory=dict)  # carry name -> the new
    #                                 value of the op's buffer (e.g. "stash": [mb, T, D])
    grads: dict[str, Any] = dataclasses.field(default_factory=dict)  # path -> float32 to add
    total: Any = 0.0                  # loss sum to add
    count: Any = 0.0                  # token count to add
    act: Any = None                   # forward output, sent to stage + 1 (None: zeros)
    grad: Any = None                  # input gradient, sent to stage - 1 (None: zeros)


jax.tree_util.register_dataclass(
    StepUpdate, data_fields=["slots", "grads", "total", "count", "act", "grad"], meta_fields=[])


def write_buffer(stash: Any, value: Any, buf: jax.Array) -> Any:
    """`stash` ([buffers, ...] arrays) with buffer `buf` set to `value`. A clamping update (buf
    is in range): `.at[buf].set`'s bounds check puts a select around it, which XLA cannot run
    in place (a new whole stash array per write)."""
    return jax.tree.map(
        lambda b, v: lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), buf, 0), stash, value)

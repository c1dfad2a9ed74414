"""One rule for the public functions that take a step's `ZeroLayout` (`HybridEngine`,
`Zero3Generator`, `SingleDeviceGenerator`, `save` / `Checkpointer.save`, `memory_report`):
before the step held its layout (`step.layout`) the first three took the `ZeroStep` itself. A
`ZeroStep` given where a layout is expected still works, as its `.layout`, with a
DeprecationWarning worded as `gathered_model(step, state)`'s ("X is deprecated; call Y"); what
is neither is left to the function's own check, which names the fix."""

from __future__ import annotations

import warnings
from typing import Any

from zeroxla.engine.step import ZeroStep


def layout_argument(value: Any, old: str, new: str) -> Any:
    """`value.layout` when `value` is a `ZeroStep`, warning "`old` is deprecated; call `new`"
    (DeprecationWarning, pointing at the caller of the public function that calls this);
    `value` itself otherwise."""
    if isinstance(value, ZeroStep):
        warnings.warn(f"{old} is deprecated; call {new}", DeprecationWarning, stacklevel=3)
        return value.layout
    return value

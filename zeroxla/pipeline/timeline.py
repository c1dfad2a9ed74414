"""Pictures of a schedule: which stage computes which micro-batch at each step.

    render_text(table)        stages x steps as text, cells `F0` (forward of micro-batch 0),
                              `B3` (backward of 3; in ZB-H1 its input-gradient pass), `W3`
                              (ZB-H1's weight-gradient pass of 3) or `.` (idle: the bubble)
    plot_timeline(table, ax)  the same on a matplotlib Axes
    render_png(table, path)   ... written to a PNG file

All take a `ScheduleTable`: `render_text(schedule_table(TrainSchedule, 4, 2))`.
matplotlib is imported only by the plotting functions.
"""

from __future__ import annotations

import os
from typing import Any

from zeroxla.pipeline.table import BACKWARD, FORWARD, IDLE, WEIGHT, ScheduleTable

_LETTER = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W"}
_COLOUR = {FORWARD: "#4c72b0", BACKWARD: "#dd8452", WEIGHT: "#55a868"}
_LABEL = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight gradient"}


def _title(table: ScheduleTable) -> str:
    return (f"{table.schedule}  micro_batches={table.micro_batches}  stages={table.stages}  "
            f"bubble={table.bubble_fraction:.3f}")


def _cell(table: ScheduleTable, step_id: int, stage_id: int) -> str:
    op = table.op[step_id][stage_id]
    if op == IDLE:
        return "."
    return f"{_LETTER[op]}{table.micro_batch[step_id][stage_id]}"


def render_text(table: ScheduleTable) -> str:
    """A title line, a header of step numbers, then one row per stage, e.g. for 1F1B with two
    micro-batches on two stages:

        TrainSchedule  micro_batches=2  stages=2  bubble=0.333
        step     0  1  2  3  4  5
        stage 0  F0 .  F1 B0 .  B1
        stage 1  .  F0 B0 F1 B1 .
    """
    cells = [[_cell(table, t, s) for t in range(table.num_steps)] for s in range(table.stages)]
    width = max([len(str(table.num_steps - 1))] + [len(c) for row in cells for c in row])
    label = len(f"stage {table.stages - 1}")
    lines = [_title(table),
             "step".ljust(label) + "  " + " ".join(str(t).ljust(width)
                                                   for t in range(table.num_steps))]
    for s, row in enumerate(cells):
        lines.append(f"stage {s}".ljust(label) + "  " + " ".join(c.ljust(width) for c in row))
    return "\n".join(line.rstrip() for line in lines) + "\n"


def plot_timeline(table: ScheduleTable, ax: Any = None) -> Any:
    """Draws the schedule on `ax` (a new figure's if None): stages top to bottom, steps left to
    right, forwards, backwards and (ZB-H1) weight-gradient passes in their own colours with the
    micro-batch number in each cell. Returns the Axes."""
    if ax is None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(max(4.0, 0.45 * table.num_steps + 1.5),
                              max(1.5, 0.5 * table.stages + 1.0)))
        ax = fig.add_subplot()
    for t in range(table.num_steps):
        for s in range(table.stages):
            op = table.op[t][s]
            if op == IDLE:
                continue
            ax.add_patch(_rectangle((t, s), _COLOUR[op]))
            ax.text(t + 0.5, s + 0.5, str(table.micro_batch[t][s]), ha="center", va="center",
                    fontsize=8, color="white")
    ax.set_xlim(0, table.num_steps)
    ax.set_ylim(table.stages, 0)                        # stage 0 on top
    ax.set_xticks([t + 0.5 for t in range(table.num_steps)], [str(t) for t in range(
        table.num_steps)], fontsize=7)
    ax.set_yticks([s + 0.5 for s in range(table.stages)],
                  [f"stage {s}" for s in range(table.stages)])
    ax.set_xlabel("step")
    ax.set_title(_title(table), fontsize=9)
    from matplotlib.patches import Patch
    ops = [op for op in (FORWARD, BACKWARD, WEIGHT)
           if op in (FORWARD, BACKWARD) or any(op in row for row in table.op)]
    if WEIGHT in ops:                                   # a split backward: B is its input half
        labels = {**_LABEL, BACKWARD: "backward (input gradient)"}
    else:
        labels = _LABEL
    ax.legend(handles=[Patch(color=_COLOUR[op], label=labels[op]) for op in ops],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return ax


def _rectangle(corner: tuple[int, int], colour: str) -> Any:
    from matplotlib.patches import Rectangle
    return Rectangle(corner, 1, 1, facecolor=colour, edgecolor="white", linewidth=1)


def render_png(table: ScheduleTable, path: str | os.PathLike) -> None:
    """Writes `plot_timeline(table)` to `path` as a PNG (Agg backend; no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    ax = plot_timeline(table)
    fig = ax.figure
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png", dpi=120)

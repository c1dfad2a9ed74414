"""The PPO run's picture: mean reward and KL from the reference per iteration, side by side;
and where its time went (`time_split`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_records(records: list[dict[str, float]]) -> Any:
    """A matplotlib figure of `run_ppo`'s records: reward (left) and KL per token (right)."""
    import matplotlib.pyplot as plt

    its = [r["iteration"] for r in records]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(its, [r["reward"] for r in records], marker="o")
    ax1.set(xlabel="PPO iteration", ylabel="mean reward (score per answer)", title="reward")
    ax2.plot(its, [r["kl"] for r in records], marker="o", color="tab:red")
    ax2.set(xlabel="PPO iteration", ylabel="KL per token", title="KL(actor || reference)")
    fig.tight_layout()
    return fig


def save_records_plot(records: list[dict[str, float]], path: Path) -> None:
    """`plot_records`' figure written to `path` (PNG, 100 dpi) and closed: a job's picture is
    not left among pyplot's figures, where a notebook would show it again."""
    import matplotlib.pyplot as plt

    figure = plot_records(records)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def time_split(records: list[dict[str, float]], skip_first: bool = True) -> dict[str, float]:
    """Total seconds in generation, experience and training over `records` (without iteration
    0, which compiles, when `skip_first` and there is more than one), and their shares."""
    rows = records[1:] if skip_first and len(records) > 1 else records
    totals = {k: float(sum(r[k] for r in rows))
              for k in ("generation_s", "experience_s", "training_s")}
    whole = sum(totals.values()) or 1.0
    return {**totals, **{k.replace("_s", "_share"): v / whole for k, v in totals.items()}}

"""The PPO run's picture: mean reward and KL from the reference per iteration, side by side."""

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

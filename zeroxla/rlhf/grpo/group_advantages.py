"""Group-relative advantages of the GRPO family: one scalar per answer, from the rewards of the
G answers sampled for the same prompt.

Rows are prompt-major: row b is answer `b % G` of prompt `b // G`, so `rewards.reshape(-1, G)`
is one group per row. The baseline is the group mean (GRPO, Shao et al. 2024) or, with
`advantage="rloo"`, the mean of the group's other G - 1 rewards (RLOO, Ahmadian et al. 2024:
`r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) * (r_i - mean)`). The centred reward is then
divided by `std + 1e-4` (TRL's `GRPOTrainer`, unbiased std), the std of the group
(`scale_rewards="group"`) or of the whole batch ("batch"), or left as it is ("none", Dr.GRPO's
choice: the std reweights prompts by how hard they are). A group of equal rewards has a zero
centred reward, so its advantage is exactly 0 (no NaN: the 1e-4 keeps 0 / 0 away).

The arithmetic is float64 NumPy, cast to float32 at the end: in float32 the std's squares
overflow for rewards past ~1e19 and rewards close together (1000 and 1000.001) lose their
differences. Rewards past float32's range, or advantages that do not fit it (a huge spread with
`scale_rewards="none"`), are refused: the training step would turn them into NaN.
"""

from __future__ import annotations

import numpy as np

STD_EPS = 1e-4
FLOAT32_MAX = float(np.finfo(np.float32).max)


def group_advantages(rewards, num_generations: int, *, scale_rewards: str = "group",
                     advantage: str = "grpo") -> np.ndarray:
    """float32[B] advantages of `rewards` [B] (B a multiple of `num_generations`; any float
    dtype, NumPy or JAX), computed in float64 and then cast. ValueError when a reward or an
    advantage does not fit float32."""
    g = num_generations
    if g < 2:
        raise ValueError(f"num_generations={g} is invalid; accepted: an integer >= 2 (a group "
                         "of one answer has no baseline)")
    rewards = np.asarray(rewards, np.float64)
    if rewards.ndim != 1 or rewards.shape[0] % g:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of "
                         f"num_generations={g}; accepted: [prompts * {g}]")
    # |r| <= FLOAT32_MAX keeps float64's mean and std (squares of differences) from overflow.
    if not np.all(np.abs(rewards) <= FLOAT32_MAX):
        _refuse(rewards, scale_rewards)
    grouped = rewards.reshape(-1, g)                                      # [N, G]
    centred = grouped - grouped.mean(axis=1, keepdims=True)               # [N, G]
    centred[np.ptp(grouped, axis=1) == 0] = 0.0       # an equal group: 0 whatever the rounding
    if advantage == "rloo":
        centred = centred * (g / (g - 1))
    elif advantage != "grpo":
        raise ValueError(f"advantage={advantage!r} is invalid; accepted: grpo | rloo")
    if scale_rewards == "group":
        centred = centred / (grouped.std(axis=1, ddof=1, keepdims=True) + STD_EPS)
    elif scale_rewards == "batch":
        centred = centred / (rewards.std(ddof=1) + STD_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards={scale_rewards!r} is invalid; accepted: group | batch | "
                         "none")
    with np.errstate(over="ignore"):                           # refused below, by name
        out = centred.reshape(-1).astype(np.float32)                      # [B]
    if not np.all(np.isfinite(out)):
        _refuse(rewards, scale_rewards)
    return out


def _refuse(rewards: np.ndarray, scale_rewards: str) -> None:
    """ValueError: `rewards` (float64) or their advantages do not fit float32."""
    raise ValueError(f"rewards from {rewards.min():.4g} to {rewards.max():.4g} give advantages "
                     f"that do not fit float32 (scale_rewards={scale_rewards!r}); accepted: "
                     f"finite rewards (the weighted sum of the reward sources) within "
                     f"+-{FLOAT32_MAX:.3g} whose centred values fit it too")


__all__ = ["STD_EPS", "group_advantages"]

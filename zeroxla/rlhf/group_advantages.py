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
"""

from __future__ import annotations

import jax.numpy as jnp

STD_EPS = 1e-4


def group_advantages(rewards, num_generations: int, *, scale_rewards: str = "group",
                     advantage: str = "grpo"):
    """float32[B] advantages of `rewards` [B] (B a multiple of `num_generations`)."""
    g = num_generations
    if g < 2:
        raise ValueError(f"num_generations={g} is invalid; accepted: an integer >= 2 (a group "
                         "of one answer has no baseline)")
    if rewards.ndim != 1 or rewards.shape[0] % g:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of "
                         f"num_generations={g}; accepted: [prompts * {g}]")
    grouped = rewards.reshape(-1, g)                                      # [N, G]
    mean = jnp.mean(grouped, axis=1, keepdims=True)                       # [N, 1]
    centred = grouped - mean                                              # [N, G]
    if advantage == "rloo":
        centred = centred * (g / (g - 1))
    elif advantage != "grpo":
        raise ValueError(f"advantage={advantage!r} is invalid; accepted: grpo | rloo")
    if scale_rewards == "group":
        centred = centred / (jnp.std(grouped, axis=1, ddof=1, keepdims=True) + STD_EPS)
    elif scale_rewards == "batch":
        centred = centred / (jnp.std(rewards, ddof=1) + STD_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards={scale_rewards!r} is invalid; accepted: group | batch | "
                         "none")
    return centred.reshape(-1)                                            # [B]


__all__ = ["STD_EPS", "group_advantages"]

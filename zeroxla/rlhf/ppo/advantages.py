"""Rewards and advantages of a rollout: DeepSpeed-Chat's `compute_rewards` and
`get_advantages_and_returns` (`dschat/rlhf/ppo_trainer.py`) as pure `jnp` functions.

Every array here covers the generated span only: row b's answer is `G` tokens, of which the first
`action_mask[b].sum()` are real (a prefix; the rest is padding after EOS). Position t holds
  logprobs[b, t]      log pi(answer token t | prompt, answer[:t])     (the actor at rollout)
  ref_logprobs[b, t]  the same under the frozen reference
  values[b, t]        the critic's value of the state before answer token t
DeepSpeed-Chat indexes the same quantities over the whole sequence and slices them at
`start = prompt_length - 1`; position t here is its `start + t`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def compute_rewards(logprobs: jax.Array, ref_logprobs: jax.Array, reward_score: jax.Array,
                    action_mask: jax.Array, *, kl_ctl: float,
                    clip_reward_value: float) -> jax.Array:
    """Per-token rewards [B, G]: the KL penalty `-kl_ctl * (logprobs - ref_logprobs)` on every
    real answer token, plus the reward score (one per row, [B], clipped to
    +-clip_reward_value) on the row's last real token. Padding gets 0."""
    mask = action_mask.astype(logprobs.dtype)                            # [B, G]
    rewards = -kl_ctl * (logprobs - ref_logprobs) * mask                  # [B, G]
    last = jnp.sum(mask, axis=1).astype(jnp.int32) - 1                    # [B]
    score = jnp.clip(reward_score, -clip_reward_value, clip_reward_value)  # [B]
    at_last = jax.nn.one_hot(last, rewards.shape[1], dtype=rewards.dtype)  # [B, G]
    return rewards + at_last * score[:, None].astype(rewards.dtype)


def get_advantages_and_returns(values: jax.Array, rewards: jax.Array, action_mask: jax.Array, *,
                               gamma: float, lam: float) -> tuple[jax.Array, jax.Array]:
    """GAE (Schulman et al. 2016) over the answer: `delta_t = r_t + gamma V_{t+1} - V_t`,
    `A_t = delta_t + gamma lam A_{t+1}`, with V = 0 after the last real token (the episode ends
    there; DeepSpeed-Chat zeroes the values past the answer the same way). Returns
    (advantages, returns) [B, G], `returns = advantages + values`."""
    mask = action_mask.astype(values.dtype)
    values = values * mask                                                # [B, G]
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values                       # [B, G]

    def back(lastgaelam, delta):                                          # delta: [B]
        gae = delta + gamma * lam * lastgaelam
        return gae, gae

    _, advantages = jax.lax.scan(back, jnp.zeros_like(deltas[:, 0]), deltas.T, reverse=True)
    advantages = advantages.T                                             # [B, G]
    return advantages, advantages + values


@functools.partial(jax.jit, static_argnames=("kl_ctl", "clip_reward_value", "gamma", "lam"))
def rewards_and_advantages(logprobs, ref_logprobs, scores, values, mask, *, kl_ctl,
                           clip_reward_value, gamma, lam):
    """PPO's per-token rewards (`compute_rewards`), then GAE advantages and returns
    (`get_advantages_and_returns`), [B, G] each, as one program."""
    rewards = compute_rewards(logprobs, ref_logprobs, scores, mask, kl_ctl=kl_ctl,
                              clip_reward_value=clip_reward_value)
    advantages, returns = get_advantages_and_returns(values, rewards, mask, gamma=gamma, lam=lam)
    return rewards, advantages, returns

"""Direct Preference Optimization (Rafailov et al. 2023) as pure functions over per-sequence
log-prob sums, and the `make_step` loss_fn that trains a policy with it.

For a pair (prompt x, chosen y_w, rejected y_l), with log pi(y | x) the sum of the answer
tokens' log-probs under the policy and log ref(y | x) the same under the frozen starting model:

    chosen_reward   = beta (log pi(y_w|x) - log ref(y_w|x))      (DPO's implicit reward, §5)
    rejected_reward = beta (log pi(y_l|x) - log ref(y_l|x))
    h = (chosen_reward - rejected_reward) / beta                  (the log-ratio difference)

    sigmoid  -log sigmoid(beta h)                                 (DPO, eq. 7)
    ipo      (h - 1 / (2 beta))^2                                 (IPO, Azar et al. 2023, eq. 17)

At the start the policy is the reference, so h = 0 and every pair's sigmoid loss is exactly
log 2, with margins (chosen_reward - rejected_reward) of 0. IPO here takes the sequence sums as
the paper does; TRL's `loss_type="ipo"` divides each sum by its answer length first.

Batch layout (`DPOBatch`, rows of `pair_batch`): "chosen", "rejected" int32[B, T] (prompt +
answer (+ eos), right-padded), "chosen_mask", "rejected_mask" float32[B, T-1] (1 where the
*target* token t+1 is an answer token), "weight" float32[B] (1 for a pair, 0 for a row that only
pads an evaluation batch), "ref_chosen", "ref_rejected" float32[B] (the reference's sums,
computed once before training).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zeroxla.engine.loss import model_token_logprobs
from zeroxla.rlhf.answer_values import token_logprob_rows
from zeroxla.rlhf.packed_pairs import pair_sums, refuse_padded_pairs

LOSS_TYPES = ("sigmoid", "ipo")
DPOBatch = dict[str, jax.Array]
TOKEN_KEYS = ("chosen", "rejected")
MASK_KEYS = ("chosen_mask", "rejected_mask")
REFERENCE_KEYS = ("ref_chosen", "ref_rejected")


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """DPO's hyper-parameters (names as TRL's DPOConfig: `beta`, `loss_type`, `learning_rate`)
    and the shape of a step: `batch_size` pairs of `seq_len` tokens."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    learning_rate: float = 1e-4
    batch_size: int = 16
    seq_len: int = 64
    # The frozen reference as int8 codes (MixZ++), as PPOConfig.reference_int8.
    reference_int8: bool = False
    # Training pairs packed into rows with segment ids (`zeroxla.rlhf.packed_pairs`): the same
    # loss without the padding; the policy must take positions= and segment_ids=.
    packing: bool = True

    def __post_init__(self) -> None:
        def fail(name: str, accepted: str) -> None:
            raise ValueError(f"DPOConfig.{name}={getattr(self, name)!r} is invalid; "
                             f"accepted: {accepted}")

        for name in ("beta", "learning_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < math.inf:
                fail(name, "a finite number > 0")
        if self.loss_type not in LOSS_TYPES:
            fail("loss_type", " or ".join(repr(t) for t in LOSS_TYPES))
        for name in ("batch_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                fail(name, "an integer >= 2")
        for name in ("reference_int8", "packing"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "True or False")

    def replace(self, **changes: Any) -> "DPOConfig":
        return dataclasses.replace(self, **changes)


def pair_batch(arrays: dict[str, np.ndarray], prompt_lengths: dict[str, np.ndarray]
               ) -> dict[str, np.ndarray]:
    """`DPOBatch` rows (without the reference sums) from reward-model pair arrays ("chosen",
    "rejected" int32[N, T], "chosen_end", "rejected_end" int32[N]: the last real token) and
    each row's prompt token count {"chosen", "rejected": int[N]}: the masks select the targets
    prompt_length .. end, the answer (and its eos)."""
    out = {key: np.asarray(arrays[key], np.int32) for key in TOKEN_KEYS}
    positions = np.arange(out["chosen"].shape[1] - 1)[None, :] + 1                # targets [1, T-1]
    for key, mask_key in zip(TOKEN_KEYS, MASK_KEYS):
        start = np.maximum(np.asarray(prompt_lengths[key]), 1)[:, None]          # [N, 1]
        end = np.asarray(arrays[f"{key}_end"])[:, None]                          # [N, 1]
        out[mask_key] = ((positions >= start) & (positions <= end)).astype(np.float32)
    out["weight"] = np.ones((out["chosen"].shape[0],), np.float32)
    return out


# ---- the loss over per-sequence sums ------------------------------------------------------------
def dpo_rewards(policy_chosen: jax.Array, policy_rejected: jax.Array, ref_chosen: jax.Array,
                ref_rejected: jax.Array, *, beta: float) -> tuple[jax.Array, jax.Array]:
    """(chosen_reward, rejected_reward) [B]: beta times the policy-reference log-ratio of each
    answer, from the per-sequence log-prob sums [B]."""
    return beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected)


def dpo_loss_terms(policy_chosen: jax.Array, policy_rejected: jax.Array, ref_chosen: jax.Array,
                   ref_rejected: jax.Array, *, beta: float,
                   loss_type: str = "sigmoid") -> jax.Array:
    """The loss of each pair [B] (module docstring) from the four log-prob sums [B]."""
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)          # [B]
    if loss_type == "sigmoid":
        return -jax.nn.log_sigmoid(beta * h)
    if loss_type == "ipo":
        return jnp.square(h - 1.0 / (2.0 * beta))
    raise ValueError(f"loss_type={loss_type!r} is invalid; accepted: "
                     + " or ".join(repr(t) for t in LOSS_TYPES))


def dpo_metrics(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *,
                beta: float) -> dict[str, jax.Array]:
    """TRL's logged DPO statistics, means over the pairs: `accuracy` (share with chosen_reward
    > rejected_reward), `margin` (chosen_reward - rejected_reward), `chosen_reward`,
    `rejected_reward`."""
    chosen, rejected = dpo_rewards(policy_chosen, policy_rejected, ref_chosen, ref_rejected,
                                   beta=beta)
    return {"accuracy": jnp.mean((chosen > rejected).astype(jnp.float32)),
            "margin": jnp.mean(chosen - rejected),
            "chosen_reward": jnp.mean(chosen), "rejected_reward": jnp.mean(rejected)}


# ---- log-prob sums of a model -------------------------------------------------------------------
def sequence_logprobs(model: nnx.Module, batch: DPOBatch,
                      experts: Any = None) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) answer log-prob sums [B] under `model`, one forward over both halves
    stacked ([2B, T])."""
    b = batch["chosen"].shape[0]
    tokens = jnp.concatenate([batch["chosen"], batch["rejected"]])               # [2B, T]
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])       # [2B, T-1]
    sums = jnp.sum(token_logprob_rows(model, tokens, experts) * mask, axis=-1)   # [2B]
    return sums[:b], sums[b:]


def pair_values(model: nnx.Module, batch: DPOBatch, sequence: Any = None,
                experts: Any = None) -> tuple[jax.Array, ...]:
    """(chosen, rejected, ref_chosen, ref_rejected, weight), one value per pair [N], of padded
    pair rows (`sequence_logprobs`, the others read from the batch) or of a packed batch
    (`packed_pairs.pack_pairs`: its "segment_ids"): there each token's log-prob times its
    side's mask, and the pair values each on one slot, are summed per pair over the "pair"
    numbers of this replica's rows (`packed_pairs.pair_sums`, over the sequence devices too
    under `sequence`); N is then the replica's slots (pair numbers past its pairs have
    weight 0). `experts`: an MoE policy's `ExpertParallel` (the step passes it)."""
    if "segment_ids" not in batch:
        refuse_padded_pairs(sequence, "DPOConfig.packing=True")
        return (*sequence_logprobs(model, batch, experts), batch["ref_chosen"],
                batch["ref_rejected"], batch["weight"])
    logprobs = model_token_logprobs(model, batch["inputs"], batch["targets"],
                                    positions=batch["positions"],
                                    segment_ids=batch["segment_ids"],
                                    sequence=sequence, experts=experts)           # [R, S]
    return pair_sums(batch["pair"], logprobs * batch["chosen_mask"],
                     logprobs * batch["rejected_mask"], batch["ref_chosen"],
                     batch["ref_rejected"], batch["weight"], sequence=sequence)


# ---- make_step loss_fns -------------------------------------------------------------------------
def make_dpo_loss(beta: float, loss_type: str = "sigmoid"):
    """`loss_fn(policy, batch) -> (sum of the pairs' losses, pairs)` for `make_step`, so the
    step's loss is the exact mean over the global batch of `DPOBatch` rows (padded, or packed:
    `pair_values`; packed, under sequence parallelism as well: the step passes `sequence`)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is invalid; accepted: "
                         + " or ".join(repr(t) for t in LOSS_TYPES))

    def dpo_loss(model, batch, *, sequence=None, experts=None):
        chosen, rejected, ref_chosen, ref_rejected, weight = pair_values(model, batch, sequence,
                                                                         experts)
        terms = dpo_loss_terms(chosen, rejected, ref_chosen, ref_rejected, beta=beta,
                               loss_type=loss_type)                              # [B]
        return jnp.sum(terms * weight), jnp.sum(weight)
    return dpo_loss


def make_dpo_statistic(name: str, beta: float):
    """`loss_fn(policy, batch) -> (sum over pairs, pairs)` of one `dpo_metrics` statistic
    (`name`: "accuracy" or "margin"): a forward-only `make_step` evaluates it on the sharded
    policy with `eval_loss`, as the loss itself is, no gathered copy."""
    if name not in ("accuracy", "margin"):
        raise ValueError(f"name={name!r} is invalid; accepted: 'accuracy' or 'margin'")

    def statistic(model, batch, *, sequence=None, experts=None):
        *sums, weight = pair_values(model, batch, sequence, experts)
        chosen, rejected = dpo_rewards(*sums, beta=beta)
        value = (chosen > rejected).astype(jnp.float32) if name == "accuracy" else chosen - rejected
        return jnp.sum(value * weight), jnp.sum(weight)
    return statistic


__all__ = ["DPOBatch", "DPOConfig", "LOSS_TYPES", "dpo_loss_terms", "dpo_metrics", "dpo_rewards",
           "make_dpo_loss", "make_dpo_statistic", "pair_batch", "pair_values",
           "sequence_logprobs",
           "token_logprob_rows"]

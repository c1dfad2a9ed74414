"""`GRPOConfig`: the knobs of the GRPO family (GRPO, Dr.GRPO, DAPO, RLOO's baseline) as one frozen
dataclass. Field names are TRL's `GRPOConfig` where it has one:

  num_generations        G answers sampled per prompt (a group); G >= 2, since a group of one
                         has no baseline to be relative to
  loss_type              how per-token terms become one loss: "grpo" (mean per answer, then over
                         answers), "dr_grpo" (sum / (answers * max_completion_length), Dr.GRPO's
                         constant normaliser), "dapo" (token-level mean over the batch: TRL's
                         default)
  scale_rewards          divide the centred reward by the group's std ("group"), the batch's
                         ("batch") or not at all ("none", Dr.GRPO's choice)
  epsilon, epsilon_high  lower and upper clip of the importance ratio, [1 - epsilon,
                         1 + epsilon_high] (DAPO's clip-higher; epsilon_high None = epsilon)
  beta                   weight of the k3 KL estimator against the frozen reference (0: no
                         reference is built)
  num_iterations         mu, policy updates per rollout batch (the clip only binds when mu > 1)
  learning_rate          AdamW's
  max_completion_length  answer tokens

`rollout_correction` "tis" multiplies every per-token loss term by the truncated importance
weight min(exp(train_old - rollout), `tis_cap`) between the training forward's and the rollout
engine's log-probs of the sampled tokens (TRL's `vllm_importance_sampling_correction` and
`vllm_importance_sampling_cap`; `zeroxla.rlhf.rollout_correction`); None: no correction (the
gap is logged either way). `rollout_corr` is verl's full set (`RolloutCorrection`: token,
sequence or geometric importance sampling, truncated or IcePop's band, rejection sampling over
k1/k2/k3, bypass); "tis" is its token IS at `tis_cap` with TRL's order (`correction`).
"decoupled" is AReaL's decoupled PPO objective (Fu et al. 2025, arXiv 2505.24298): the
ratio's pi_old is the proximal policy (the training forward at the current weights) and each
token's policy term is weighted by pi_prox / pi_behav, pi_behav the engine's log-prob of the
version that drew the token, a weight above `behav_imp_weight_cap` set to 0 (None: uncapped;
`RolloutCorrection.decoupled`): what stale (`max_staleness`) and partial rollouts train on.

`advantage` ("grpo" | "rloo") chooses the baseline: the group mean, or RLOO's leave-one-out mean
of the other G - 1 answers (Ahmadian et al. 2024). `prompts_per_iteration` prompts make
`prompts_per_iteration * num_generations` rows per rollout; `prompt_length` is the most prompt
tokens (shorter prompts are right-padded, exactly; a longer one keeps its last tokens:
`zeroxla.rlhf.grpo.prompts`). Rollouts
sample at temperature 1, from the policy's own distribution, so the log-probs of the ratio are
the model's (no temperature enters them).

`packing` (on by default) trains on the rollout packed: each answer's sequence (prompt and
answer) placed whole into rows of `packed_row_len` tokens (None: the longest sequence's,
`prompt_length + max_completion_length - 1`) with segment ids, the rows balanced over the data
replicas (`zeroxla.rlhf.packed_rollout`, verl's `use_remove_padding` + `balance_batch`): the
same loss as the padded rows, without their padding. The actor must take `positions` and
`segment_ids` (every family in `models` does); off: one right-padded row per answer.
`ppo_max_token_len_per_gpu` (verl's name, its `use_dynamic_bsz`; needs `packing`, replaces
`packed_row_len`) is a token budget: rows of that many tokens per device, each data replica's
rows its micro-batches, their gradients accumulated into one update (the same mean), so an
actor step's activations are one row's however long the rollout's answers.

`routing_replay` (an MoE actor; routing replay, R3): "measure" records the experts each layer
chose for every token of the rollout (continuous or static decode, `HybridEngine.generate(
..., return_routing=True)`) and logs `routing/mismatch`, the (token, layer) pairs where the actor's
training forward routes otherwise; "on" also trains on the record: every recorded token sent
to its recorded experts, weighed by the live router (`models.moe`), for the old, the
reference's and the trained log-probs alike; "off" records nothing. "measure" and "on" need
`packing`. "auto" (the default) is resolved by the trainer for its actor
(`roles.resolve_routing_replay`, the trainer's `config` holding the result): "on" for an MoE
actor, "off" for a dense one, and "off" with a warning naming why where "on" cannot run for an
MoE actor (no routing records for its family, `packing=False`, `partial_rollout`).

`rollout_dtype` ("float32" | "bfloat16", `HybridEngineConfig.rollout_dtype`): the dtype the
rollout engine decodes in. "bfloat16" is verl's and slime's rollout against float32 training
masters: the rollout's log-probs and MoE routing then differ from the training forward's (the
gap and `routing/mismatch` measure it; routing replay and the rollout correction act on it).

`batch_invariant` (a Llama or MoE Llama actor, `LlamaConfig.batch_invariant`): the actor is
rebuilt in the batch-invariant mode (`roles.batch_invariant_policy`: every sum in a fixed
order), so at inference_tp_size=1 the rollout's log-probs equal the training forward's exactly
and an MoE actor routes every token as its rollout did. Needs a float32 rollout.

`rollout_devices` N > 0 (asynchronous GRPO, `zeroxla.rlhf.async_rollouts`): the last N devices of
the mesh are a rollout group that generates while the first ones train (N: half the devices);
`max_staleness` k lets iteration i's rollout be drawn from the weights of iteration >= i - k
(0: the synchronous loop's order). 0 (the default): the Hybrid Engine colocated with training.
`partial_rollout` N > 0 (with `max_staleness` >= 1; verl's partial rollout): a rollout drawn
ahead draws at most N tokens per answer at each sync, and an unfinished answer is continued from
its tokens (its KV recomputed) with the newer weights at the next: each token carries the
version that drew it (`zeroxla.rlhf.partial_rollout`).

The rewards a job names beside the config (`zeroxla grpo`'s `--reward-funcs`, `--reward-weights`
and a `--reward` model): checked (`check_reward_sources`) and loaded (`reward_sources`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from zeroxla.rlhf.grpo.reward_funcs import RewardFunctions, load_reward_func
from zeroxla.rlhf.rollout_correction import RolloutCorrection
from zeroxla.rlhf.rollout_fields import check_async_fields, check_rollout_fields

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
ADVANTAGES = ("grpo", "rloo")
ROLLOUT_CORRECTIONS = ("tis", "decoupled")


class GRPOConfigError(ValueError):
    """A bad GRPOConfig value: its `field`, `value` and what is `accepted` (the message names
    the field; `zeroxla grpo` names the option instead)."""

    def __init__(self, field: str, value: Any, accepted: str):
        super().__init__(f"GRPOConfig.{field}={value!r} is invalid; accepted: {accepted}")
        self.field, self.value, self.accepted = field, value, accepted


def _check(name: str, value: Any, ok: bool, accepted: str) -> None:
    if not ok:
        raise GRPOConfigError(name, value, accepted)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """The GRPO family's hyper-parameters (TRL's defaults where it has one, except
    `learning_rate`, sized for the tiny models here). Every field is validated; a bad value is
    a ValueError naming it."""

    num_generations: int = 8
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    num_iterations: int = 1
    advantage: str = "grpo"
    learning_rate: float = 1e-3
    prompts_per_iteration: int = 8
    prompt_length: int = 16
    max_completion_length: int = 16
    # The frozen reference (beta > 0) as int8 codes, as PPOConfig.reference_int8.
    reference_int8: bool = False
    rollout_correction: str | None = None
    tis_cap: float = 2.0
    rollout_corr: RolloutCorrection = RolloutCorrection()
    packing: bool = True
    packed_row_len: int | None = None
    ppo_max_token_len_per_gpu: int | None = None
    routing_replay: str = "auto"
    rollout_dtype: str = "float32"
    rollout_devices: int = 0
    max_staleness: int = 0
    behav_imp_weight_cap: float | None = None    # rollout_correction="decoupled"'s (AReaL's)
    partial_rollout: int = 0
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        _check("num_generations", self.num_generations,
               _is_int(self.num_generations) and self.num_generations >= 2,
               "an integer >= 2 (group-relative advantages need at least two answers per "
               "prompt; G = 1 has no baseline)")
        for name, choices in (("loss_type", LOSS_TYPES), ("scale_rewards", SCALE_REWARDS),
                              ("advantage", ADVANTAGES)):
            value = getattr(self, name)
            _check(name, value, value in choices, " | ".join(choices))
        _check("epsilon", self.epsilon, _is_number(self.epsilon) and 0 < self.epsilon < 1,
               "a number in (0, 1)")
        _check("epsilon_high", self.epsilon_high, self.epsilon_high is None or (
            _is_number(self.epsilon_high) and self.epsilon_high > 0), "None or a number > 0")
        _check("beta", self.beta, _is_number(self.beta) and self.beta >= 0, "a number >= 0")
        _check("learning_rate", self.learning_rate,
               _is_number(self.learning_rate) and self.learning_rate > 0, "a number > 0")
        for name in ("num_iterations", "prompts_per_iteration", "prompt_length",
                     "max_completion_length"):
            value = getattr(self, name)
            _check(name, value, _is_int(value) and value >= 1, "an integer >= 1")
        _check("rollout_correction", self.rollout_correction,
               self.rollout_correction is None or self.rollout_correction in ROLLOUT_CORRECTIONS,
               "None (no correction) | tis (truncated importance sampling) | decoupled "
               "(AReaL's decoupled PPO objective)")
        _check("tis_cap", self.tis_cap, _is_number(self.tis_cap) and self.tis_cap > 0,
               "a number > 0 (the largest importance weight)")
        _check("rollout_corr", self.rollout_corr, isinstance(
            self.rollout_corr, RolloutCorrection) and not (
                self.rollout_correction and self.rollout_corr.active),
            "a RolloutCorrection, inactive with a rollout_correction (tis: token IS at "
            "tis_cap; decoupled: AReaL's weights)")
        _check("reference_int8", self.reference_int8, isinstance(self.reference_int8, bool),
               "True or False")
        _check("packing", self.packing, isinstance(self.packing, bool), "True or False")
        _check("packed_row_len", self.packed_row_len, self.packed_row_len is None or (
            _is_int(self.packed_row_len)
            and self.packed_row_len >= self.prompt_length + self.max_completion_length - 1),
            f"None or an integer >= prompt_length + max_completion_length - 1 = "
            f"{self.prompt_length + self.max_completion_length - 1} (the longest sequence "
            "stays whole in one row)")
        budget = self.ppo_max_token_len_per_gpu
        _check("ppo_max_token_len_per_gpu", budget, budget is None or (
            _is_int(budget) and budget >= 1 and self.packing and self.packed_row_len is None),
            "None or an integer >= 1 with packing=True and packed_row_len=None (the budget "
            "is the packed rows' length per device)")
        check_rollout_fields(self, _check)
        check_async_fields(self, _check)
        cap = self.behav_imp_weight_cap
        _check("behav_imp_weight_cap", cap, cap is None or (
            _is_number(cap) and cap > 1 and self.rollout_correction == "decoupled"),
            "None, or a number > 1 with rollout_correction='decoupled' (AReaL's: weights "
            "above it are 0)")
        _check("partial_rollout", self.partial_rollout, _is_int(self.partial_rollout) and (
            self.partial_rollout == 0 or (
                0 < self.partial_rollout < self.max_completion_length
                and self.max_staleness >= 1 and self.routing_replay in ("auto", "off"))),
            f"0 (off), or an integer in [1, max_completion_length={self.max_completion_length}"
            ") with max_staleness >= 1 (an answer is carried to a later sync) and "
            "routing_replay='auto' or 'off'")

    @property
    def clip_high(self) -> float:
        """The upper clip epsilon: `epsilon_high`, or `epsilon` when it is None."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def correction(self) -> RolloutCorrection | None:
        """The rollout correction in force: `rollout_corr`, "tis"'s token IS at `tis_cap`, or
        "decoupled"'s weights filtered at `behav_imp_weight_cap`; None when nothing is
        corrected."""
        if self.rollout_correction == "tis":
            return RolloutCorrection.tis(self.tis_cap)
        if self.rollout_correction == "decoupled":
            return RolloutCorrection.decoupled(self.behav_imp_weight_cap)
        return self.rollout_corr if self.rollout_corr.active else None

    @property
    def row_len(self) -> int:
        """Tokens per packed row: `packed_row_len`, or the longest sequence's slots."""
        return self.packed_row_len or self.prompt_length + self.max_completion_length - 1

    @property
    def rows_per_iteration(self) -> int:
        """Answers per rollout: prompts_per_iteration * num_generations."""
        return self.prompts_per_iteration * self.num_generations

    def replace(self, **changes: Any) -> "GRPOConfig":
        return dataclasses.replace(self, **changes)


def check_reward_sources(names: Sequence[str], weights: Sequence[float] | None, *,
                         prompts: bool, with_model: bool) -> None:
    """ValueError naming the options unless a job given `prompts` has a reward (`names` or a
    reward model) and `weights` holds one weight per source (the functions, then the model)."""
    if prompts and not names and not with_model:
        raise ValueError("--prompts without --reward-funcs or --reward: no reward; accepted: "
                         "at least one of them")
    sources = len(names) + with_model
    if weights is not None and len(weights) != sources:
        raise ValueError(f"--reward-weights has {len(weights)} values for {sources} reward "
                         "sources (--reward-funcs, then --reward); accepted: one weight per "
                         "source")


def reward_sources(names: Sequence[str], weights: Sequence[float] | None, with_model: bool,
                   loaded: Sequence[Callable[..., Any]] | None = None
                   ) -> tuple[RewardFunctions | None, float]:
    """The reward functions `names` (`load_reward_func`: built in, or `module:function`, whose
    module is imported here, so one that fails is named before anything else runs) with their
    weights, and the reward model's weight: `weights` holds one per function, then one for the
    reward model when `with_model` (None: 1.0 each). `loaded`: the functions of `names` a
    Python caller already holds (the trainer API's callables), one per name, used as given."""
    model_weight = weights[-1] if weights and with_model else 1.0
    if loaded is not None and len(loaded) != len(names):
        raise ValueError(f"{len(loaded)} loaded reward functions for the {len(names)} names "
                         f"{', '.join(names)}; accepted: one function per name")
    if not names:
        return None, model_weight
    funcs = (tuple(loaded) if loaded is not None
             else tuple(load_reward_func(name) for name in names))
    return RewardFunctions(funcs, tuple(weights[:len(funcs)]) if weights else None), model_weight

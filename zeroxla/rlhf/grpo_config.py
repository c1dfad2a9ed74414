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

`advantage` ("grpo" | "rloo") chooses the baseline: the group mean, or RLOO's leave-one-out mean
of the other G - 1 answers (Ahmadian et al. 2024). `prompts_per_iteration` prompts make
`prompts_per_iteration * num_generations` rows per rollout; `prompt_length` is the most prompt
tokens (shorter prompts are right-padded, exactly; a longer one keeps its last tokens:
`zeroxla.rlhf.grpo_prompts`). Rollouts
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
chose for every token of the rollout (the static decode, `HybridEngine.generate(...,
return_routing=True)`) and logs `routing/mismatch`, the (token, layer) pairs where the actor's
training forward routes otherwise; "on" also trains on the record: every recorded token sent
to its recorded experts, weighed by the live router (`models.moe`), for the old, the
reference's and the trained log-probs alike; "off" (the default) records nothing. Needs
`packing`.

The rewards a job names beside the config (`zeroxla grpo`'s `--reward-funcs`, `--reward-weights`
and a `--reward` model): checked (`check_reward_sources`) and loaded (`reward_sources`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from zeroxla.rlhf.reward_funcs import RewardFunctions, load_reward_func
from zeroxla.rlhf.rollout_correction import RolloutCorrection

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
ADVANTAGES = ("grpo", "rloo")
ROLLOUT_CORRECTIONS = ("tis",)
ROUTING_REPLAY = ("off", "measure", "on")


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
    # The frozen reference (beta > 0) as int8 codes: refused, as PPOConfig.reference_int8.
    reference_int8: bool = False
    rollout_correction: str | None = None
    tis_cap: float = 2.0
    rollout_corr: RolloutCorrection = RolloutCorrection()
    packing: bool = True
    packed_row_len: int | None = None
    ppo_max_token_len_per_gpu: int | None = None
    routing_replay: str = "off"

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
               "None (no correction) | tis (truncated importance sampling)")
        _check("tis_cap", self.tis_cap, _is_number(self.tis_cap) and self.tis_cap > 0,
               "a number > 0 (the largest importance weight)")
        _check("rollout_corr", self.rollout_corr, isinstance(
            self.rollout_corr, RolloutCorrection) and not (
                self.rollout_correction and self.rollout_corr.active),
            "a RolloutCorrection, inactive with rollout_correction='tis' (its alias: token IS "
            "at tis_cap)")
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
        _check("routing_replay", self.routing_replay, self.routing_replay in ROUTING_REPLAY and (
            self.packing or self.routing_replay == "off"),
            " | ".join(ROUTING_REPLAY) + " (measure and on with packing=True: the replayed "
            "forward is the packed one)")

    @property
    def clip_high(self) -> float:
        """The upper clip epsilon: `epsilon_high`, or `epsilon` when it is None."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def correction(self) -> RolloutCorrection | None:
        """The rollout correction in force: `rollout_corr`, or "tis"'s token IS at `tis_cap`;
        None when nothing is corrected."""
        if self.rollout_correction == "tis":
            return RolloutCorrection.tis(self.tis_cap)
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

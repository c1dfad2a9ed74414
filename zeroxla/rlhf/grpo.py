"""The GRPO family's loop on zeroxla (TRL's `GRPOTrainer` shape): the actor is a ZeRO-3
`make_step` with the GRPO `loss_fn`, rollouts come from the Hybrid Engine, the reference is
frozen, and there is no critic: the baseline is the group of answers to the same prompt.

One iteration (`GRPOTrainer.iteration`: `generate_experience`, then `train_grpo`):
1. draw `prompts_per_iteration` prompt rows (`(seed, iteration)`, without replacement while
   there are enough);
2. sample `num_generations` answers to each with the Hybrid Engine, one `generate` call per
   generation index with its own seed (the engine draws a prompt's tokens from the seed and
   the prompt's ids, so equal prompts in one call would get equal answers); the TP copy is
   released after, as in PPO; the engine also returns the log-prob it drew each token with;
3. the answers' log-probs under the actor (the "old" policy of the ratio) and the reference
   (a frozen copy of the actor's first partitions), in the actor step's layout
   (`answer_forward`), as `PPOTrainer`; the rewards (weighted reward
   functions on the texts, and/or a reward model's end score), group-relative advantages;
4. `num_iterations` actor steps on the whole rollout (with `packing`, packed into rows with
   segment ids and balanced over the data replicas: `packed_rollout`, the same loss without
   the padding); before each step after the first, the clipped fraction of that step's
   ratio is measured in the same layout (an MoE actor's router load: `router/*`). Each record
   holds the train/rollout log-prob gap (`rollout_correction.logprob_gap`, as `gap/*`), and
   with a rollout correction (`GRPOConfig.correction`) every step's terms carry its
   importance weights, its rejected tokens are out of the loss, and its metrics are in the
   record (`rollout_corr/*`).
   A step whose gradients are not finite skips its update (`check_grad_overflow`): the actor
   keeps its last finite parameters, and the non-finite loss is in the record.

The policy is the softmax over the tokenizer's ids (`vocab_limit = tokenizer.vocab_size`, as
PPO): a padded vocabulary's rows are never drawn, and the log-probs are of that distribution.

Rows are prompt-major: row b is answer `b % G` of prompt `b // G` (`group_advantages`).
Prompts keep their own lengths, up to `prompt_length` (a longer one keeps its last tokens,
counted in `GRPOTrainer.prompts`, and the reward functions get the kept text): each row is its
prompt, its answer, then zeros (`grpo_prompts`), exact without an attention mask.

With an enabled `lora` (`zeroxla.lora.LoRAConfig`) the actor trains LoRA adapters (alone with
`only_optimize_lora`), the reference is the plain starting actor, and the Hybrid Engine
generates with base + adapters (`zeroxla.inference.adapter_switch`: when only the adapters
changed, only they are resharded).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import zeroxla
from zeroxla.lora import LoRAConfig
from zeroxla.engine.loss import check_packable
from zeroxla.engine.router_aux import check_budget_with_router, router_record
from zeroxla.inference.config import rollout_batching
from zeroxla.rlhf.answer_forward import AnswerForward, reference_partitions
from zeroxla.rlhf.group_advantages import group_advantages
from zeroxla.rlhf.grpo_config import GRPOConfig
from zeroxla.rlhf.grpo_eval import exact_accuracy, greedy_accuracy
from zeroxla.rlhf.grpo_losses import clip_fractions, make_grpo_loss
from zeroxla.rlhf.grpo_prompts import PromptRows, prompt_rows
from zeroxla.rlhf.packed_rollout import check_token_budget, pack_for_step
from zeroxla.rlhf.reward import make_scorer
from zeroxla.rlhf.roles import build_roles
from zeroxla.rlhf.reward_funcs import RewardFunctions
from zeroxla.inference.checks import check_routing
from zeroxla.rlhf.rollout import (generation_stats, pad_answers, pad_logprobs, pad_routing,
                                  routing_metrics)
from zeroxla.rlhf.rollout_correction import corrected_batch, logprob_gap


@dataclasses.dataclass(frozen=True)
class GRPORollout:
    """One iteration's experience (B = prompts * G rows; T = max_completion_length)."""

    tokens: np.ndarray                   # int32[B, P + T]: prompt, answer, zeros
    action_mask: np.ndarray              # float32[B, T], 1 on real answer tokens (a prefix)
    completions: tuple[str, ...]         # the answers, decoded
    rewards: np.ndarray                  # float64[B], the weighted reward per answer
    reward_parts: dict[str, np.ndarray]  # each reward function's (and the reward model's) [B]
    advantages: np.ndarray               # float32[B]
    logprobs: np.ndarray                 # float32[B, T], the actor at rollout time
    ref_logprobs: np.ndarray             # float32[B, T], the frozen reference
    rollout_logprobs: np.ndarray | None = None   # float32[B, T], as the engine drew them
    prompt_lengths: np.ndarray | None = None     # int32[B], answer starts (None: P each)
    routing: np.ndarray | None = None     # int32[B, P + T, L, k], the rollout's experts per token
    routing_mismatch: tuple[int, int] = (0, 0)   # (token, layer) pairs differing, compared

    def answer_starts(self) -> np.ndarray:
        """int32[B]: the column of each row's first answer token (its prompt's length)."""
        if self.prompt_lengths is not None:
            return np.asarray(self.prompt_lengths, np.int32)
        width = self.tokens.shape[1] - self.action_mask.shape[1]
        return np.full(self.tokens.shape[:1], width, np.int32)

    def kl(self) -> float:
        """Mean over real tokens of the k3 estimator of KL(actor || reference)."""
        delta = (self.ref_logprobs - self.logprobs)[self.action_mask > 0].astype(np.float64)
        return float(np.mean(np.exp(delta) - delta - 1.0))


class GRPOTrainer:
    """Actor and reference of one GRPO-family run (see the module docstring).

    `actor` is the initial policy (plain, e.g. `zeroxla.gathered_model` of an SFT state);
    `prompts` are rows {"prompt": text, ...} of 1 to `prompt_length` tokens (a longer prompt
    keeps its last ones, as TRL's `max_prompt_length` and DeepSpeed-Chat's prompt dataset do;
    `self.prompts` counts them and holds the kept text): every other key is handed to the
    reward functions as a keyword (one value per answer), e.g. the bundled task's `answer`.
    `reward_funcs` are `RewardFunctions` (or callables, weight 1 each); `reward_model` (a plain
    `RewardModel`) adds its end score times `reward_model_weight`. `eos_id` ends an answer
    (kept, as its last token). `lora`: adapters on a copy of the actor (A drawn from `seed`).
    `optimizer`: the actor's (None: AdamW at `config.learning_rate`).
    """

    def __init__(self, config: GRPOConfig, actor: nnx.Module, *, mesh: Any, tokenizer: Any,
                 prompts: Sequence[dict[str, Any]],
                 reward_funcs: RewardFunctions | Sequence[Callable] = (),
                 reward_model: Any = None, reward_model_weight: float = 1.0,
                 inference_tp_size: int = 2, eos_id: int | None = None, seed: int = 0,
                 lora: LoRAConfig | None = None,
                 optimizer: optax.GradientTransformation | None = None):
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}")
        if not isinstance(reward_funcs, RewardFunctions):
            reward_funcs = RewardFunctions(tuple(reward_funcs)) if reward_funcs else None
        if reward_funcs is None and reward_model is None:
            raise ValueError("no reward: accepted: reward_funcs (callables (prompts, "
                             "completions, **row_fields) -> list[float]) and/or a reward_model")
        if config.packing:
            check_packable(actor, "GRPOConfig.packing", "actor")
        if config.ppo_max_token_len_per_gpu is not None:      # before any step is built
            check_budget_with_router(
                actor, f"GRPOConfig.ppo_max_token_len_per_gpu={config.ppo_max_token_len_per_gpu}",
                "ppo_max_token_len_per_gpu=None", "the actor")
        self.reward_funcs, self.reward_model_weight = reward_funcs, reward_model_weight
        self.score_model = None if reward_model is None else make_scorer(reward_model=reward_model)
        self.config, self.tokenizer, self.eos_id, self.seed = config, tokenizer, eos_id, seed
        self.prompts: PromptRows = prompt_rows(prompts, tokenizer, config.prompt_length)
        self.vocab_limit = getattr(tokenizer, "vocab_size", None)   # the tokenizer's ids
        optimizer = optax.adamw(config.learning_rate) if optimizer is None else optimizer
        roles = build_roles(
            actor, mesh, optimizer=optimizer, seed=seed, lora=lora,
            loss_fn=make_grpo_loss(loss_type=config.loss_type, epsilon=config.epsilon,
                                   epsilon_high=config.clip_high, beta=config.beta,
                                   vocab_limit=self.vocab_limit, kl_weighted=(
                                       config.correction is None
                                       or config.correction.kl_weighted)),
            hybrid_engine=zeroxla.HybridEngineConfig(      # every answer decodes at once
                inference_tp_size=inference_tp_size, batching=(
                    "auto" if config.routing_replay == "off" else "static"),  # it records
                max_out_tokens=config.prompt_length + config.max_completion_length,
                **rollout_batching(config.prompts_per_iteration, config.num_generations,
                                   mesh.devices.size // inference_tp_size, config.prompt_length)))
        self.actor_step, self.engine, self.actor_state = roles.step, roles.engine, roles.state
        if config.routing_replay != "off":        # an MoE actor: refused by name otherwise
            check_routing(roles.step.layout.model_def, self.engine.batching)
        check_token_budget(config.ppo_max_token_len_per_gpu, config.row_len, roles.step.layout,
                           "GRPOConfig")
        # Every per-token read in the actor's layout; the reference (the plain actor: LoRA's
        # first adapters are B = 0) a copy of its first partitions.
        self.answers = AnswerForward(roles.step, "logprobs", self.vocab_limit, config.packing)
        self.reference_state = reference_partitions(roles.step, roles.state, owner="GRPOConfig",
                                                    int8=config.reference_int8)

    # ---- rollout ---------------------------------------------------------------------------
    def sample_prompts(self, iteration: int) -> np.ndarray:
        """Indices of this iteration's `prompts_per_iteration` prompt rows."""
        n, k = len(self.prompts.ids), self.config.prompts_per_iteration
        rng = np.random.default_rng((self.seed, iteration))
        return rng.choice(n, k, replace=n < k)

    def generate(self, picked: np.ndarray, iteration: int) -> tuple[list[np.ndarray], ...]:
        """G answers per picked prompt, prompt-major (row b: prompt b // G, answer b % G),
        the log-probs [new] the engine drew each answer's tokens with, and with
        `routing_replay` each output's routing record [len(output), L, k]."""
        c = self.config
        prompts = [self.prompts.ids[i] for i in picked]
        results = self.engine.generate_group(      # each prompt prefilled once
            self.actor_state, prompts, [(self.seed * 100_003 + iteration) * 1_009 + g
                                        for g in range(c.num_generations)],
            max_new_tokens=c.max_completion_length, temperature=1.0, eos_id=self.eos_id,
            vocab_limit=self.vocab_limit, return_logprobs=True,
            return_routing=c.routing_replay != "off")
        self.engine.release()          # the next optimizer step makes the TP copy stale anyway
        order = [(g, p) for p in range(len(prompts)) for g in range(c.num_generations)]
        return tuple([lists[g][p] for g, p in order] for lists in results)

    def score(self, picked: np.ndarray, tokens: np.ndarray, mask: np.ndarray,
              completions: tuple[str, ...]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The weighted reward per answer [B] and each source's rewards; `mask` [B, P + T] is 1
        on each row's prompt and answer tokens (a prefix)."""
        rows = [self.prompts.rows[i] for i in picked for _ in range(self.config.num_generations)]
        keys = sorted({k for row in rows for k in row if k != "prompt"})
        fields = {k: [row.get(k) for row in rows] for k in keys}
        total, parts = np.zeros(len(rows)), {}
        if self.reward_funcs is not None:
            total, parts = self.reward_funcs([r["prompt"] for r in rows], completions, fields)
        if self.score_model is not None:
            # a whole-row mask: the scorer's end, prompt columns + ones - 1, is then each
            # row's last real token (`reward.answer_end_scores`)
            scores = np.asarray(self.score_model(tokens, mask, completions), np.float64)
            parts["reward_model"] = scores
            total = total + self.reward_model_weight * scores
        return total, parts

    def generate_experience(self, iteration: int) -> tuple[GRPORollout, float, float]:
        """One rollout; returns it with the seconds spent generating and scoring it."""
        c = self.config
        start = time.perf_counter()
        picked = self.sample_prompts(iteration)
        outputs, drawn, *records = self.generate(picked, iteration)
        generation_s = time.perf_counter() - start
        start = time.perf_counter()
        starts = np.asarray([self.prompts.ids[i].size for i in picked
                             for _ in range(c.num_generations)], np.int32)           # [B]
        tokens, mask = pad_answers(outputs, c.prompt_length, c.max_completion_length, starts)
        completions = tuple(self.tokenizer.decode(row[start:row.size])
                            for row, start in zip(outputs, starts))
        real = np.arange(tokens.shape[1]) < np.asarray([row.size for row in outputs])[:, None]
        rewards, parts = self.score(picked, tokens, real.astype(np.float32), completions)
        advantages = group_advantages(rewards, c.num_generations,
                                      scale_rewards=c.scale_rewards, advantage=c.advantage)
        routing = pad_routing(records[0], tokens.shape[1]) if records else None
        logprobs, mismatch = self.routed_logprobs(tokens, starts, mask, routing)
        ref_logprobs, _ = self.routed_logprobs(tokens, starts, mask, routing, reference=True)
        rollout = GRPORollout(tokens=tokens, action_mask=mask, completions=completions,
                              rewards=rewards, reward_parts=parts,
                              advantages=np.asarray(advantages, np.float32),
                              logprobs=np.asarray(logprobs, np.float32),
                              ref_logprobs=np.asarray(ref_logprobs, np.float32),
                              rollout_logprobs=pad_logprobs(drawn, mask), prompt_lengths=starts,
                              routing=routing, routing_mismatch=mismatch)
        return rollout, generation_s, time.perf_counter() - start

    def logprobs(self, tokens: np.ndarray, prompt_lengths: np.ndarray, mask: np.ndarray,
                 reference: bool = False) -> jax.Array:
        """The current actor's (`reference`: the frozen reference's) answer log-probs [B, T]
        (0 where `mask` is) of right-padded `tokens` [B, P + T] whose row b's answer starts at
        `prompt_lengths[b]`, in the actor step's layout (`answer_forward`; the reference its
        first partitions)."""
        return self.answers(self.reference_state if reference else self.actor_state,
                            tokens, mask, prompt_lengths)

    def routed_logprobs(self, tokens: np.ndarray, prompt_lengths: np.ndarray, mask: np.ndarray,
                        routing: np.ndarray | None, reference: bool = False
                        ) -> tuple[np.ndarray, tuple[int, int]]:
        """`logprobs`, the rollout's `routing` record [B, P + T, L, k] replayed when
        `routing_replay` is "on" (None: `logprobs`), and the (token, layer) pairs whose live
        routing is not the record, and those compared ((0, 0) without a record)."""
        return self.answers.routed(self.reference_state if reference else self.actor_state,
                                   tokens, mask, routing, prompt_lengths,
                                   follow_record=self.config.routing_replay == "on")

    # ---- training --------------------------------------------------------------------------
    def train_grpo(self, rollout: GRPORollout) -> dict[str, float]:
        """`num_iterations` actor steps on `rollout`; returns the mean loss and the clipped
        fractions (mean over the steps after the first; 0 when there is one step: its ratio
        is 1), with a rollout correction its metrics (`rollout_corr/*`; with "tis" also
        `tis_clipped_fraction`, the share of tokens the cap truncates), and with `packing`
        the packed
        batch's `packing/rows`, `fill`, `replica_imbalance` (and `micro_batches`)."""
        c = self.config
        starts = rollout.answer_starts()
        batch = {"tokens": rollout.tokens, "prompt_lengths": starts,
                 "old_logprobs": rollout.logprobs, "advantages": rollout.advantages,
                 "action_mask": rollout.action_mask}
        if c.beta:
            batch["ref_logprobs"] = rollout.ref_logprobs
        if c.routing_replay == "on":             # packed as "replay": the loss replays it
            batch["routing"] = rollout.routing
        tis = {}
        if c.correction is not None:
            batch, tis = corrected_batch(c.correction, batch, rollout.rollout_logprobs)
        old = batch["old_logprobs"]              # pi_old: the rollout's under bypass
        if c.rollout_correction == "tis":
            tis["tis_clipped_fraction"] = tis["rollout_corr/rollout_is_clipped_fraction"]
        packed, micro = {}, None
        if c.packing:          # the same loss, without the padding (`packed_rollout`)
            batch, stats, micro = pack_for_step(
                batch, self.actor_step.layout, loss_type=c.loss_type, row_len=c.row_len,
                token_budget=c.ppo_max_token_len_per_gpu, owner="GRPOConfig")
            packed = {f"packing/{k}": v for k, v in stats.items()}
        losses, clips = [], []
        for k in range(c.num_iterations):
            if k:
                clips.append({name: float(v) for name, v in clip_fractions(self.routed_logprobs(
                    rollout.tokens, starts, rollout.action_mask, rollout.routing)[0], old,
                    rollout.advantages,
                    rollout.action_mask, epsilon=c.epsilon, epsilon_high=c.clip_high).items()})
            self.actor_state, metrics = self.actor_step(self.actor_state, batch,
                                                        gradient_accumulation_steps=micro)
            losses.append(float(metrics["loss"]))       # one program in flight at a time
        return {"loss": float(np.mean(losses)), **tis, **packed, **router_record(metrics),
                **{key: float(np.mean([x[key] for x in clips])) if clips else 0.0
                   for key in ("clip_low", "clip_high", "clip_fraction")}}

    def iteration(self, it: int) -> tuple[dict[str, Any], GRPORollout]:
        """Iteration `it` (0-based): one rollout, then its `num_iterations` actor steps;
        its record (`iteration_record`) and rollout."""
        rollout, generation_s, scoring_s = self.generate_experience(it)
        start = time.perf_counter()
        train = self.train_grpo(rollout)
        jax.block_until_ready(self.actor_state)
        return iteration_record(it, rollout, train, {
            "generation_s": generation_s, "scoring_s": scoring_s,
            "training_s": time.perf_counter() - start, **generation_stats(self.engine)}), rollout

    def accuracy(self, problems: Sequence[dict[str, Any]]) -> float:
        """`greedy_accuracy` of the current actor on `problems` (held-out, each with its
        `answer`), generated by the trainer's own Hybrid Engine."""
        accuracy = greedy_accuracy(self.engine, self.actor_state, problems, self.tokenizer,
                                   self.config, self.eos_id)
        self.engine.release()
        return accuracy

    def actor_model(self) -> nnx.Module:
        """The current actor, gathered (a plain model with full weights)."""
        return zeroxla.gathered_model(self.actor_state)


def iteration_record(iteration: int, rollout: GRPORollout, train: dict[str, float],
                     times: dict[str, float]) -> dict[str, Any]:
    """One metrics.jsonl record: rewards (mean, per source, and `accuracy` when the
    `accuracy_reward` is one of them), KL, loss, clipped fractions, answer length, times, and
    the train/rollout log-prob gap (`gap/max`, `gap/mean_abs`, `gap/frac_over_1e-3`)."""
    record = {"iteration": iteration, "reward": float(np.mean(rollout.rewards)),
              "reward_std": float(np.std(rollout.rewards)),
              **{f"reward/{name}": float(np.mean(v)) for name, v in rollout.reward_parts.items()},
              "kl": rollout.kl(), **train,
              "completion_length": float(np.mean(rollout.action_mask.sum(1))), **times}
    if rollout.routing is not None:          # `GRPOConfig.routing_replay`
        record.update(routing_metrics(rollout.routing_mismatch))
    if rollout.rollout_logprobs is not None:
        record.update({f"gap/{k}": float(v) for k, v in logprob_gap(
            rollout.logprobs, rollout.rollout_logprobs, rollout.action_mask).items()})
    if "accuracy_reward" in rollout.reward_parts:
        record["accuracy"] = float(np.mean(rollout.reward_parts["accuracy_reward"]))
    return record


@dataclasses.dataclass
class GRPORun:
    """What `run_grpo` returns: one record and one rollout per iteration, and the trainer."""

    records: list[dict[str, Any]]
    rollouts: list[GRPORollout]
    trainer: GRPOTrainer


def run_grpo(config: GRPOConfig, iterations: int, actor: nnx.Module, *, mesh: Any,
             tokenizer: Any, prompts: Sequence[dict[str, Any]],
             reward_funcs: RewardFunctions | Sequence[Callable] = (), reward_model: Any = None,
             reward_model_weight: float = 1.0, inference_tp_size: int = 2,
             eos_id: int | None = None, seed: int = 0, trainer: GRPOTrainer | None = None,
             start_iteration: int = 0, should_stop: Callable[[], bool] = lambda: False,
             on_iteration: Callable[[dict[str, Any]], None] | None = None,
             lora: LoRAConfig | None = None) -> GRPORun:
    """Iterations `start_iteration` .. `iterations - 1` of the GRPO family from `actor` (see
    `GRPOTrainer` for the arguments; `trainer` continues an existing one, e.g. restored).
    `should_stop()` is read before each iteration (a stop request: the run returns early).
    Each record (`iteration_record`) holds the seconds spent in `generation_s` (Hybrid
    Engine), `scoring_s` and `training_s` (the first's including compilation), and the
    engine's tokens/s, prefill and KV pages (`rollout.generation_stats`)."""
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise ValueError(f"iterations={iterations!r} is invalid; accepted: an integer >= 1")
    if trainer is None:
        trainer = GRPOTrainer(config, actor, mesh=mesh, tokenizer=tokenizer, prompts=prompts,
                              reward_funcs=reward_funcs, reward_model=reward_model,
                              reward_model_weight=reward_model_weight,
                              inference_tp_size=inference_tp_size, eos_id=eos_id, seed=seed,
                              lora=lora)
    records, rollouts = [], []
    for it in range(start_iteration, iterations):
        if should_stop():
            break
        record, rollout = trainer.iteration(it)
        records.append(record)
        rollouts.append(rollout)
        if on_iteration is not None:
            on_iteration(record)
    return GRPORun(records, rollouts, trainer)


__all__ = ["GRPORollout", "GRPORun", "GRPOTrainer", "exact_accuracy", "greedy_accuracy",
           "iteration_record", "run_grpo"]

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
prompt, its answer, then zeros (`prompts`), exact without an attention mask.

With an enabled `lora` (`zeroxla.lora.LoRAConfig`) the actor trains LoRA adapters (alone with
`only_optimize_lora`), the reference is the plain starting actor, and the Hybrid Engine
generates with base + adapters (`zeroxla.inference.adapter_switch`: when only the adapters
changed, only they are resharded).

With `rollout_devices` the rollouts come from a rollout group on devices of their own, drawn
up to `max_staleness` versions ahead while the training group updates (`async_rollouts`), with
`partial_rollout` in passes whose unfinished answers continue after a sync (`partial_rollout`).
"""

from __future__ import annotations

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
from zeroxla.rlhf.grpo.config import GRPOConfig
from zeroxla.rlhf.async_rollouts import AsyncRollouts, split_mesh
from zeroxla.rlhf.grpo.experience import (DrawnRollout, GRPORollout, finish_rollout,
                                          iteration_record)
from zeroxla.rlhf.grpo.eval import exact_accuracy, greedy_accuracy
from zeroxla.rlhf.grpo.losses import clip_fractions, make_grpo_loss
from zeroxla.rlhf.grpo.prompts import PromptRows, prompt_rows
from zeroxla.rlhf.packed_rollout import check_token_budget, pack_for_step
from zeroxla.rlhf.partial_rollout import PartialAnswers, continue_answers
from zeroxla.rlhf.reward import make_scorer
from zeroxla.rlhf.roles import build_roles, resolve_routing_replay
from zeroxla.rlhf.grpo.reward_funcs import RewardFunctions
from zeroxla.rlhf.rollout import generation_stats
from zeroxla.rlhf.rollout_correction import corrected_batch


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
        self.config, self.tokenizer, self.eos_id, self.seed = config, tokenizer, eos_id, seed
        self.prompts: PromptRows = prompt_rows(prompts, tokenizer, config.prompt_length)
        self.vocab_limit = getattr(tokenizer, "vocab_size", None)   # the tokenizer's ids
        optimizer = optax.adamw(config.learning_rate) if optimizer is None else optimizer
        mesh, rollout_mesh = split_mesh(mesh, config.rollout_devices, lora)   # None: colocated
        self.score_model = (None if reward_model is None
                            else make_scorer(reward_model=reward_model, mesh=mesh))
        roles = build_roles(
            actor, mesh, optimizer=optimizer, seed=seed, lora=lora, rollout_mesh=rollout_mesh,
            batch_invariant=config.batch_invariant,
            loss_fn=make_grpo_loss(loss_type=config.loss_type, epsilon=config.epsilon,
                                   epsilon_high=config.clip_high, beta=config.beta,
                                   vocab_limit=self.vocab_limit, kl_weighted=(
                                       config.correction is None
                                       or config.correction.kl_weighted)),
            hybrid_engine=zeroxla.HybridEngineConfig(      # every answer decodes at once
                inference_tp_size=inference_tp_size, batching="auto",
                rollout_dtype=config.rollout_dtype,
                max_out_tokens=config.prompt_length + config.max_completion_length,
                **rollout_batching(config.prompts_per_iteration, config.num_generations,
                                   mesh.devices.size // inference_tp_size, config.prompt_length)))
        self.actor_step, self.engine, self.actor_state = roles.step, roles.engine, roles.state
        self.rollouts = None if roles.rollout is None else AsyncRollouts(
            roles.rollout, config.max_staleness, self, config.partial_rollout or None)
        # "auto" resolved for the built actor; an explicit mode checked against it
        self.config = config = resolve_routing_replay(config, roles.step.layout.model_def)
        check_token_budget(config.ppo_max_token_len_per_gpu, config.row_len, roles.step.layout,
                           "GRPOConfig")
        # Every per-token read in the actor's layout; the reference (the plain actor: LoRA's
        # first adapters are B = 0) a copy of its first partitions.
        self.answers = AnswerForward(roles.step, "logprobs", self.vocab_limit, config.packing)
        self.reference_state = reference_partitions(roles.step, roles.state, owner="GRPOConfig",
                                                    int8=config.reference_int8)
        self.reference_answers = self.answers.reading(self.reference_state)   # int8: its view

    # ---- rollout ---------------------------------------------------------------------------
    @property
    def policy(self) -> Any:
        """The state rollouts are drawn from: the actor's, or the rollout group's synced copy
        (`rollout_devices`: `async_rollouts`)."""
        return self.actor_state if self.rollouts is None else self.rollouts.group.state

    def sample_prompts(self, iteration: int) -> np.ndarray:
        """Indices of this iteration's `prompts_per_iteration` prompt rows."""
        n, k = len(self.prompts.ids), self.config.prompts_per_iteration
        rng = np.random.default_rng((self.seed, iteration))
        return rng.choice(n, k, replace=n < k)

    def seeds(self, iteration: int) -> list[int]:
        """The seed of each generation index g of iteration `iteration`'s answers."""
        return [(self.seed * 100_003 + iteration) * 1_009 + g
                for g in range(self.config.num_generations)]

    def generate(self, picked: np.ndarray, iteration: int, tokens: int | None = None
                 ) -> tuple[list[np.ndarray], ...]:
        """G answers per picked prompt, prompt-major (row b: prompt b // G, answer b % G), of
        at most `tokens` new tokens (None: `max_completion_length`), the log-probs [new] the
        engine drew each answer's tokens with, and with `routing_replay` each output's
        routing record [len(output), L, k]."""
        c = self.config
        prompts = [self.prompts.ids[i] for i in picked]
        results = self.engine.generate_group(      # each prompt prefilled once
            self.policy, prompts, self.seeds(iteration),
            max_new_tokens=tokens or c.max_completion_length, temperature=1.0,
            eos_id=self.eos_id,
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
        drawn = self.finish(self.start(iteration))
        start = time.perf_counter()
        rollout = self.experience(drawn)
        return rollout, drawn.generation_s, drawn.scoring_s + time.perf_counter() - start

    def start(self, iteration: int, version: int | None = None, tokens: int | None = None
              ) -> PartialAnswers:
        """Rollout `iteration`'s first pass from `policy` (version `version`): at most
        `tokens` new tokens per answer (None: whole answers; `partial_rollout`). `start`,
        `advance` and `finish` are the rollout side, nothing the training group computes."""
        c, start = self.config, time.perf_counter()
        picked = self.sample_prompts(iteration)
        partial = PartialAnswers.empty(iteration, picked, [
            self.prompts.ids[i] for i in picked for _ in range(c.num_generations)],
            c.max_completion_length, self.eos_id)
        outputs, drawn, *records = self.generate(picked, iteration, tokens)
        partial.extend(range(len(outputs)), outputs, drawn, version)
        partial.routing = records[0] if records else None
        partial.generation_s = time.perf_counter() - start
        return partial

    def advance(self, partial: PartialAnswers, version: int | None, tokens: int | None = None
                ) -> None:
        """A later pass over `partial`'s unfinished answers from `policy` (version `version`):
        each continued from its tokens by at most `tokens` (None: to its end)."""
        continue_answers(lambda prompts, **kw: self.engine.generate(
            self.policy, prompts, temperature=1.0, eos_id=self.eos_id,
            vocab_limit=self.vocab_limit, return_logprobs=True, **kw),
            partial, self.seeds(partial.iteration), tokens, version)
        self.engine.release()

    def finish(self, partial: PartialAnswers) -> DrawnRollout:
        """`partial`'s finished answers scored (`experience.finish_rollout`)."""
        return finish_rollout(partial, self.config, self.tokenizer.decode, self.score)

    def experience(self, d: DrawnRollout) -> GRPORollout:
        """`d` with its answers' log-probs under the actor now (the "old" policy of the ratio)
        and the reference, in the training group."""
        logprobs, mismatch = self.routed_logprobs(d.tokens, d.prompt_lengths, d.action_mask,
                                                  d.routing)
        ref_logprobs, _ = self.routed_logprobs(d.tokens, d.prompt_lengths, d.action_mask,
                                               d.routing, reference=True)
        return GRPORollout(tokens=d.tokens, action_mask=d.action_mask,
                           completions=d.completions, rewards=d.rewards,
                           reward_parts=d.reward_parts, advantages=d.advantages,
                           logprobs=np.asarray(logprobs, np.float32),
                           ref_logprobs=np.asarray(ref_logprobs, np.float32),
                           rollout_logprobs=d.rollout_logprobs, prompt_lengths=d.prompt_lengths,
                           routing=d.routing, routing_mismatch=mismatch, versions=d.versions)

    def logprobs(self, tokens: np.ndarray, prompt_lengths: np.ndarray, mask: np.ndarray,
                 reference: bool = False) -> jax.Array:
        """The current actor's (`reference`: the frozen reference's) answer log-probs [B, T]
        (0 where `mask` is) of right-padded `tokens` [B, P + T] whose row b's answer starts at
        `prompt_lengths[b]`, in the actor step's layout (`answer_forward`; the reference its
        first partitions)."""
        if reference:
            return self.reference_answers(self.reference_state, tokens, mask, prompt_lengths)
        return self.answers(self.actor_state, tokens, mask, prompt_lengths)

    def routed_logprobs(self, tokens: np.ndarray, prompt_lengths: np.ndarray, mask: np.ndarray,
                        routing: np.ndarray | None, reference: bool = False
                        ) -> tuple[np.ndarray, tuple[int, int]]:
        """`logprobs`, the rollout's `routing` record [B, P + T, L, k] replayed when
        `routing_replay` is "on" (None: `logprobs`), and the (token, layer) pairs whose live
        routing is not the record, and those compared ((0, 0) without a record)."""
        forward, state = ((self.reference_answers, self.reference_state) if reference
                          else (self.answers, self.actor_state))
        return forward.routed(state, tokens, mask, routing, prompt_lengths,
                              follow_record=self.config.routing_replay == "on")

    # ---- training --------------------------------------------------------------------------
    def train_grpo(self, rollout: GRPORollout,
                   overlap: Callable[[], None] | None = None) -> dict[str, float]:
        """`num_iterations` actor steps on `rollout` (`overlap()` runs once the first is
        dispatched, before anything of it is read: `async_rollouts`'s rollouts drawn ahead);
        returns the mean loss and the clipped fractions (mean over the steps after the first;
        0 when there is one step: its ratio is 1), with a rollout correction its metrics
        (`rollout_corr/*`; with "tis" also `tis_clipped_fraction`, the share of tokens the cap
        truncates), and with `packing` the packed batch's `packing/rows`, `fill`,
        `replica_imbalance` (and `micro_batches`)."""
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
            if overlap is not None and k == 0:
                overlap()
            losses.append(float(metrics["loss"]))       # one program in flight at a time
        return {"loss": float(np.mean(losses)), **tis, **packed, **router_record(metrics),
                **{key: float(np.mean([x[key] for x in clips])) if clips else 0.0
                   for key in ("clip_low", "clip_high", "clip_fraction")}}

    def iteration(self, it: int) -> tuple[dict[str, Any], GRPORollout]:
        """Iteration `it` (0-based): one rollout, then its `num_iterations` actor steps;
        its record (`iteration_record`) and rollout."""
        if self.rollouts is None:
            rollout, generation_s, scoring_s = self.generate_experience(it)
            start = time.perf_counter()
            train = self.train_grpo(rollout)
        else:                     # drawn ahead by the rollout group (`async_rollouts`)
            drawn = self.rollouts.take(it, self.actor_state)
            start = time.perf_counter()
            rollout = self.experience(drawn)
            generation_s, scoring_s = drawn.generation_s, drawn.scoring_s
            train = self.train_grpo(rollout, lambda: self.rollouts.launch_ahead(it))
            train.update(self.rollouts.record(it, drawn))
        jax.block_until_ready(self.actor_state)
        return iteration_record(it, rollout, train, {
            "generation_s": generation_s, "scoring_s": scoring_s,
            "training_s": time.perf_counter() - start, **generation_stats(self.engine)}), rollout

    def accuracy(self, problems: Sequence[dict[str, Any]]) -> float:
        """`greedy_accuracy` of the current actor on `problems` (held-out, each with its
        `answer`), generated by the trainer's own Hybrid Engine."""
        if self.rollouts is not None:     # the actor now, outside the pipeline's versions
            self.rollouts.sync(self.actor_state, None)
        accuracy = greedy_accuracy(self.engine, self.policy, problems, self.tokenizer,
                                   self.config, self.eos_id)
        self.engine.release()
        return accuracy

    def actor_model(self) -> nnx.Module:
        """The current actor, gathered (a plain model with full weights)."""
        return zeroxla.gathered_model(self.actor_state)


__all__ = ["GRPORollout", "GRPOTrainer", "exact_accuracy", "greedy_accuracy",
           "iteration_record"]

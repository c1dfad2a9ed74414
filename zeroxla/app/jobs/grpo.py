"""`zeroxla grpo`: the GRPO family (GRPO, Dr.GRPO, DAPO, RLOO's baseline) with verifiable rewards.

    zeroxla grpo --actor runs/sft --iterations 50                    # the bundled task
    zeroxla grpo --actor runs/sft --prompts rows.jsonl --reward-funcs mymod:score --out runs/g

Without `--prompts`, the bundled arithmetic task, whose held-out problems are scored greedily
before the run, every `--eval-every` iterations and at the end (`val_accuracy`). A unit is one
iteration (`zeroxla.rlhf.GRPOTrainer.iteration`), counted from 0 in metrics.jsonl. LoRA
adapters go on the actor, not the frozen reference. The run is the runner's (`zeroxla.app.run`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from zeroxla.app.cli_args import (finite_float, non_negative_float, non_negative_int,
                                  positive_float, positive_int)
from zeroxla.app.data_files import check_split
from zeroxla.app.prompt_files import prompt_records
from zeroxla.app.jobs.loading import (BASE_KEY, adapters_base, check_adapters,
                                      check_inference_tp, load_actor, load_reward)
from zeroxla.app.run.command import JobSpec
from zeroxla.app.run.job import RunSettings, ShardingSettings, check_sections
from zeroxla.app.run.options import (DATA_FORMS, LORA_OPTIONS, RUN_OPTIONS, SHARDING_OPTIONS,
                                     Option, OptionTable, check_one_correction,
                                     named_correction_options, rollout_correction_options,
                                     split_option, token_budget_option)
from zeroxla.app.tokenizers.records import tokenizer_record
from zeroxla.checkpoint.adapters import METADATA_KEY as LORA_KEY, as_metadata
from zeroxla.engine.router_aux import check_budget_with_router
from zeroxla.inference.config import ROLLOUT_DTYPES
from zeroxla.lora import LoRAConfig
from zeroxla.rlhf.grpo.trainer import GRPOTrainer
from zeroxla.rlhf.grpo.config import (ADVANTAGES, LOSS_TYPES, ROLLOUT_CORRECTIONS,
                                      SCALE_REWARDS, GRPOConfig, check_reward_sources,
                                      reward_sources)
from zeroxla.rlhf.rollout_fields import ROUTING_REPLAY
from zeroxla.rlhf.grpo.prompts import (TASK_REWARDS, check_fit, file_rows, prompt_cap, task_rows,
                                       truncation_report)
from zeroxla.rlhf.plot import save_records_plot
from zeroxla.rlhf.roles import batch_invariant_policy
from zeroxla.rlhf.rollout_correction import RolloutCorrection


@dataclasses.dataclass(frozen=True)
class GRPOJobConfig:
    """Everything `zeroxla grpo` needs; `grpo.prompt_length` becomes `prompt_length`, else the
    longest prompt's tokens (a longer prompt keeps its last ones: `rlhf.grpo.prompts`)."""

    actor: str
    prompts: str | None = None               # None: the bundled arithmetic task
    split: str | None = None                 # a DatasetDict's split of --prompts
    reward_funcs: tuple[str, ...] = ()       # default with the task: accuracy, format
    reward_weights: tuple[float, ...] | None = None
    reward: str | None = None                # a `zeroxla reward` run or HF reward model
    grpo: GRPOConfig = GRPOConfig()
    prompt_length: int | None = None
    iterations: int = 10
    inference_tp_size: int = 2
    sharding: ShardingSettings = ShardingSettings()
    run: RunSettings = RunSettings()
    lora: LoRAConfig = LoRAConfig()          # the actor's adapters (dim 0: none)
    rollout_corr: RolloutCorrection = RolloutCorrection()    # verl's; becomes grpo.rollout_corr

    def __post_init__(self) -> None:
        check_sections(self)
        for name in ("iterations", "inference_tp_size", "prompt_length"):
            value = getattr(self, name)
            if (value is not None or name != "prompt_length") and (
                    not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"GRPOJobConfig.{name}={value!r} is invalid; accepted: an "
                                 "integer >= 1")
        check_one_correction(self.grpo.rollout_correction, self.rollout_corr)
        check_split(self.split, self.prompts, "--prompts")
        check_reward_sources(self.reward_names, self.reward_weights,
                             prompts=self.prompts is not None, with_model=self.reward is not None)
        # Each rollout (prompts x generations rows) is one global batch of the actor's step.
        self.sharding.check_batch(self.grpo.rows_per_iteration,
                                  "--per-iteration-prompts x --num-generations")
        self.sharding.check_packing(self.grpo.packing)

    @property
    def reward_names(self) -> tuple[str, ...]:
        """--reward-funcs, or the bundled task's rewards without --prompts."""
        return self.reward_funcs or (TASK_REWARDS if self.prompts is None else ())


def _row(flag: str, field: str, theme: str, help: str, **kw: Any) -> Option:
    return Option(flag, field, None, field, theme, help, **kw)


GRPO_ROWS = tuple(Option(flag, field, "grpo", field, "grpo", help if "action" in kw else
                         f"{help}; default {{default}}", **kw) for flag, field, help, kw in (
    ("--num-generations", "num_generations", "G, answers per prompt (>= 2)",
     dict(type=positive_int)),
    ("--loss-type", "loss_type", "the per-token terms' aggregation", dict(choices=LOSS_TYPES)),
    ("--scale-rewards", "scale_rewards", "the std dividing centred rewards",
     dict(choices=SCALE_REWARDS)),
    ("--advantage", "advantage", "the baseline: the group mean (grpo) or leave-one-out (rloo)",
     dict(choices=ADVANTAGES)),
    ("--epsilon", "epsilon", "lower clip of the ratio, in (0, 1)", dict(type=positive_float)),
    ("--epsilon-high", "epsilon_high", "upper clip (DAPO's clip-higher; none: --epsilon)",
     dict(type=positive_float)),
    ("--beta", "beta", "the k3 KL's weight (to the reference)", dict(type=non_negative_float)),
    ("--num-iterations", "num_iterations", "updates per rollout (mu)", dict(type=positive_int)),
    ("--learning-rate", "learning_rate", "AdamW's", dict(type=positive_float)),
    ("--per-iteration-prompts", "prompts_per_iteration", "prompts per rollout",
     dict(type=positive_int)),
    ("--max-completion-length", "max_completion_length", "answer tokens",
     dict(type=positive_int)),
    ("--reference-int8", "reference_int8", "the frozen reference (--beta > 0) as int8 codes "
     "of the actor's first partitions (MixZ++), dequantized per layer",
     dict(action="store_true")),
    ("--packing", "packing", "train on the rollout packed: each answer with its prompt placed "
     "whole into rows of --packed-row-len tokens, told apart by segment ids, the rows balanced "
     "over the data replicas (the padded rows' loss without their padding: verl's "
     "use_remove_padding + balance_batch); --no-packing: one right-padded row per answer; "
     "default on", dict(action=argparse.BooleanOptionalAction)),
    ("--packed-row-len", "packed_row_len", "tokens per packed row, at least the longest "
     "sequence's (none: --max-prompt-seq-len + --max-completion-length - 1)",
     dict(type=positive_int, metavar="T")),
    ("--routing-replay", "routing_replay", "an MoE actor's routing replay (R3): measure: the "
     "rollout records each token's experts per layer (either batching) and routing/mismatch "
     "counts the pairs the training forward routes otherwise; on: training also replays the "
     "record (the weights from the live router); auto (default): on for an MoE actor, off "
     "for a dense one or, with a warning naming why, where on cannot run (--no-packing, "
     "--partial-rollout, a family without routing records)", dict(choices=ROUTING_REPLAY)),
    ("--batch-invariant", "batch_invariant", "the actor (a Llama or MoE Llama family) rebuilt "
     "in the batch-invariant mode: every matmul, norm, softmax and attention summed in a fixed "
     "order, so at --inference-tp-size 1 the rollout's log-probs equal the training forward's "
     "exactly and an MoE actor routes as its rollout did (static batching; slower)",
     dict(action="store_true")),
    ("--rollout-dtype", "rollout_dtype", "the rollout engine's dtype: bfloat16 decodes (and "
     "reshards, at half the bytes) in bf16 against the float32 masters, as verl and slime "
     "roll out", dict(choices=ROLLOUT_DTYPES)),
    ("--rollout-devices", "rollout_devices", "asynchronous GRPO: the last N devices of --mesh "
     "generate (a rollout group) while the first ones train; N is half the devices, 0 "
     "colocated (refused with LoRA, --sequence-parallel-size, --expert-parallel-size)",
     dict(type=non_negative_int, metavar="N")),
    ("--max-staleness", "max_staleness", "with --rollout-devices: iteration i's rollout drawn "
     "from the weights of iteration >= i - k, while the update runs (0: synchronous)",
     dict(type=non_negative_int, metavar="K")),
    ("--partial-rollout", "partial_rollout", "with --max-staleness >= 1: a rollout drawn "
     "ahead draws at most N tokens per answer at each sync, an unfinished answer continued "
     "from its tokens with the newer weights (verl's partial rollout; 0: off)",
     dict(type=non_negative_int, metavar="N"))))

OPTIONS = OptionTable("grpo", GRPOJobConfig, (
    _row("--actor", "actor", "job", "a zeroxla run (or checkpoint) recording its tokenizer: the "
         "policy's start and the frozen reference; required unless --resume", metavar="SFT_RUN",
         fixed=True),
    _row("--prompts", "prompts", "job", f"{{\"prompt\", ...}} rows: {DATA_FORMS}; the prompt "
         "a string or chat messages (rendered with the actor's chat template); the other "
         "columns go to the reward functions (verl's reward_model.ground_truth as "
         "ground_truth). Default: the bundled arithmetic task", metavar="ROWS"),
    split_option("--prompts"),
    _row("--reward-funcs", "reward_funcs", "job", "accuracy | format | module:function, each "
         "(prompts, completions, **row_fields) -> list[float]; default with the bundled task: "
         "accuracy format", metavar="FUNC", nargs="+", to_tree=tuple),
    _row("--reward-weights", "reward_weights", "job", "one weight per --reward-funcs entry, then "
         "one for --reward (default 1)", type=finite_float, metavar="W", nargs="+",
         to_tree=tuple),
    _row("--reward", "reward", "job", "a zeroxla reward run or HF reward model: its end score is "
         "a reward", metavar="RM_RUN"),
    _row("--iterations", "iterations", "job", "default {default}", type=positive_int),
    _row("--inference-tp-size", "inference_tp_size", "parallel", "tensor-parallel devices of the "
         "Hybrid Engine's rollouts; default {default}", type=positive_int),
    *GRPO_ROWS, *named_correction_options("grpo", "grpo", ROLLOUT_CORRECTIONS),
    *rollout_correction_options("grpo"), token_budget_option("grpo", "grpo"),
    _row("--max-prompt-seq-len", "prompt_length", "grpo", "most prompt tokens (a longer prompt "
         "keeps its last N, counted in the log and summary.json); default: the longest "
         "prompt's", type=positive_int, metavar="N"),
    # the actor's step is ZeRO-3 (the Hybrid Engine reads its partitions): no --zero-stage
    *(row for row in SHARDING_OPTIONS if row.flag != "--zero-stage"), *RUN_OPTIONS, *LORA_OPTIONS),
    {"job": "the actor, the prompts and the rewards", "parallel": "parallelism",
     "grpo": "GRPO hyper-parameters (TRL's GRPOConfig names and defaults)", "run": "the run",
     "lora": "LoRA: adapters on the actor's (not the frozen reference's) weights"},
    unit="iteration")


class GRPOJob:
    """GRPO as the runner drives it (`zeroxla.app.run.job.Job`): one iteration a unit."""

    NAME: ClassVar[str] = "grpo"
    UNIT: ClassVar[str] = "iteration"
    COUNTER: ClassVar[tuple[str, int]] = ("iteration", 1)      # from 0 in metrics.jsonl
    EXPORT_DIR: ClassVar[str] = "actor_hf"
    PARTS: ClassVar[tuple[None]] = (None,)
    DATA: ClassVar[dict[str, str]] = {"--prompts": "prompts"}
    EVALUATE_FIRST: ClassVar[bool] = True        # finish's `before`: accuracy_before
    label = NAME

    def __init__(self, config: GRPOJobConfig,
                 reward_funcs: Sequence[Callable[..., Any]] | None = None):
        """`reward_funcs`: the functions `config.reward_funcs` names, already held by a Python
        caller (`zeroxla.app.trainers.GRPOTrainer`'s callables); None: loaded by name."""
        self.config = c = config
        self.total = c.iterations
        funcs, weight = reward_sources(c.reward_names, c.reward_weights, c.reward is not None,
                                       loaded=reward_funcs)
        mesh = c.sharding.job_mesh()
        actor, self.tokenizer = load_actor(c.actor)
        if c.grpo.batch_invariant:           # the training forward and the rollout engine
            actor = batch_invariant_policy(actor, "--batch-invariant", c.inference_tp_size,
                                           "--inference-tp-size")
        model, model_config = f"--actor {c.actor}", getattr(actor, "config", None)
        rows, self.held_out, eos_id = (
            task_rows(self.tokenizer, model) if c.prompts is None
            else file_rows(prompt_records(c.prompts, c.split, self.tokenizer), self.tokenizer))
        grpo = c.grpo.replace(prompt_length=prompt_cap(rows + self.held_out, self.tokenizer,
                                                       c.prompt_length),
                              rollout_corr=c.rollout_corr)
        check_fit(grpo.prompt_length, grpo.max_completion_length,
                  getattr(model_config, "max_seq_len", None), capped=bool(c.prompt_length),
                  model=model)
        check_inference_tp(c.inference_tp_size, c.sharding.mesh, model_config, model)
        check_adapters(model_config, c.lora)
        if grpo.ppo_max_token_len_per_gpu is not None:
            check_budget_with_router(actor, f"--ppo-max-token-len-per-gpu "
                                     f"{grpo.ppo_max_token_len_per_gpu}",
                                     "no --ppo-max-token-len-per-gpu", model)
        self.trainer = GRPOTrainer(
            grpo, actor, mesh=mesh, tokenizer=self.tokenizer, prompts=rows,
            reward_funcs=funcs or (), reward_model_weight=weight,
            reward_model=None if c.reward is None else load_reward(c.reward, actor,
                                                                    self.tokenizer),
            inference_tp_size=c.inference_tp_size, eos_id=eos_id, seed=c.run.seed, lora=c.lora)
        self.step = self.trainer.actor_step
        self.truncation, self.cut_line = truncation_report(self.trainer.prompts, self.held_out,
                                                           self.tokenizer)

    state = property(lambda self: self.trainer.actor_state,
                     lambda self, value: setattr(self.trainer, "actor_state", value))

    def parts(self) -> dict[None, "GRPOJob"]:
        return {None: self}

    def describe(self, first: int) -> str:
        c, g = self.config, self.trainer.config
        line = (f"zeroxla grpo: actor {c.actor}, {len(self.trainer.prompts.ids)} prompts of up "
                f"to {g.prompt_length} tokens ({c.prompts or 'the bundled arithmetic task'}), "
                f"iterations {first}..{c.iterations - 1} of {g.prompts_per_iteration} prompts x "
                f"{g.num_generations} answers, loss {g.loss_type}, routing replay "
                f"{g.routing_replay}"
                + (f", LoRA rank {c.lora.dim}" if c.lora.enabled else ""))
        return line if self.cut_line is None else f"{self.cut_line}\n{line}"

    def advance(self, done: int) -> dict[str, float]:
        record, _ = self.trainer.iteration(done)
        del record["iteration"]                  # the runner's: done, counted from 0
        return record

    def evaluate(self) -> dict[str, float]:
        """The bundled task's held-out greedy exact-answer accuracy ({} with --prompts)."""
        return {"val_accuracy": self.trainer.accuracy(self.held_out)} if self.held_out else {}

    def say(self, r: dict[str, Any]) -> str:
        accuracy = f"  accuracy {r['accuracy']:.3f}" if "accuracy" in r else ""
        return (f"iteration {r['iteration']:>3}: reward {r['reward']:.4f}{accuracy}  KL "
                f"{r['kl']:.5f}  loss {r['loss']:.4f}  clipped {r['clip_fraction']:.3f}"
                + (f"  | held-out accuracy {r['val_accuracy']:.3f}" if "val_accuracy" in r else ""))

    def checkpoint_metadata(self, out: Path, part: None) -> dict[str, Any]:
        del out
        return {"tokenizer": tokenizer_record(self.tokenizer), BASE_KEY: adapters_base(
            self.config.actor), LORA_KEY: as_metadata(self.config.lora)}

    def checkpoint_model_config(self, part: None) -> None:
        return None                   # the actor's own

    def restored(self, metadata: dict[str, Any]) -> None:
        del metadata                  # the reference is the --actor run's: unchanged

    def draw(self, out: Path, records: list[dict[str, Any]]) -> None:
        save_records_plot(records, out / "reward_kl.png")   # reward and KL

    def finish(self, out: Path, records: list[dict[str, Any]],
               before: dict[str, float]) -> dict[str, Any]:
        return {"iterations": self.total, "first_reward": records[0]["reward"],
                "last_reward": records[-1]["reward"], "last_kl": records[-1]["kl"],
                "accuracy_before": before.get("val_accuracy"),
                "accuracy_after": records[-1].get("val_accuracy"),
                "prompt_truncation": self.truncation, "lora": dataclasses.asdict(self.config.lora),
                "paths": {"checkpoint": str(out / "checkpoint"), "actor_hf": str(out / "actor_hf")},
                "grpo": dataclasses.asdict(self.trainer.config)}


SPEC = JobSpec(
    "grpo", help="GRPO / Dr.GRPO / DAPO / RLOO with verifiable rewards (no critic)",
    description="The GRPO family from an SFT run under ZeRO-3: answers from the Hybrid Engine, "
                "rewards from reward functions and/or a reward model, group-relative "
                "advantages, the clipped surrogate. Without --prompts, the bundled arithmetic "
                "task. Writes metrics.jsonl, reward_kl.png, summary.json, checkpoint/, actor_hf/.",
    table=OPTIONS, job=GRPOJob,
    required={"actor": "a zeroxla run directory whose checkpoint records its tokenizer"})

__all__ = ["GRPOJob", "GRPOJobConfig", "OPTIONS", "SPEC"]

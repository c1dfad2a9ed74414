"""`zeroxla ppo`: DeepSpeed-Chat's step 3 on the runs of steps 1 and 2.

    zeroxla ppo --actor runs/sft --reward runs/rm --prompts prompts.jsonl --out runs/ppo

The actor and its frozen reference are the SFT run's (`zeroxla train`) final checkpoint; the
reward model a `zeroxla reward` run or a Hugging Face `*ForSequenceClassification` (num_labels=1,
with the actor's vocabulary); the critic starts from it, as DeepSpeed-Chat's does. The reward is
its score of prompt + answer at the answer's last real token plus the per-token KL penalty
(`zeroxla.rlhf.compute_rewards`); the Hybrid Engine generates the rollouts from the actor's
ZeRO-3 partitions; prompts keep their last `--max-prompt-seq-len` tokens
(`chat_data.prompt_rows`). With `--lora-dim` the actor and the critic (not the reference) get
adapters; the summary's "parameters" and "memory" say what trains and what it holds. The
`--rollout-*` options are verl's rollout correction of the actor's loss, as `zeroxla grpo`'s;
`--rollout-devices` and `--max-staleness` draw the rollouts on devices of their own, up to K
versions behind (asynchronous PPO, `zeroxla.rlhf.async_rollouts`, as `zeroxla grpo`'s), and
`--rollout-correction decoupled` trains on them with AReaL's decoupled objective
(`RolloutCorrection.decoupled` at `--behav-imp-weight-cap`, as `zeroxla grpo`'s).

One iteration a unit (`zeroxla.rlhf.PPOTrainer.iteration`), one metrics.jsonl record each. The
runner saves checkpoint/actor and checkpoint/critic and exports the actor to actor_hf/; at the
end the job writes reward_kl.png and rollouts/<iteration>.npz of the first and the last
iteration it ran (`zeroxla.rlhf.Rollout.load`: tokens, scores, the critic's values, ...).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar

import jax

from zeroxla.app import chat_data
from zeroxla.app.cli_args import (non_negative_float, non_negative_int, positive_float,
                                  positive_int, unit_interval)
from zeroxla.app.jobs.loading import REWARD_KIND, check_inference_tp, load_actor, load_reward
from zeroxla.app.run.command import JobSpec
from zeroxla.app.run.job import RunSettings, ShardingSettings, check_sections
from zeroxla.app.data_files import check_split
from zeroxla.app.run.options import (DATA_FORMS, LORA_OPTIONS, RUN_OPTIONS, SHARDING_OPTIONS,
                                     Option, OptionTable, check_one_correction,
                                     named_correction_options, packing_option,
                                     rollout_correction_options, split_option,
                                     token_budget_option)
from zeroxla.app.run.rundir import part_dir
from zeroxla.app.run.runner import finite
from zeroxla.app.tokenizers.records import tokenizer_record
from zeroxla.checkpoint.adapters import METADATA_KEY as LORA_KEY
from zeroxla.checkpoint.adapters import as_metadata
from zeroxla.lora import LoRAConfig
from zeroxla.rlhf import PPOConfig, PPOTrainer, Rollout, time_split
from zeroxla.rlhf.plot import save_records_plot
from zeroxla.rlhf.roles import batch_invariant_policy
from zeroxla.rlhf.rollout_correction import RolloutCorrection
from zeroxla.rlhf.rollout_fields import ROUTING_REPLAY
from zeroxla.inference.config import ROLLOUT_DTYPES

PLOT_FILE = "reward_kl.png"
ROLLOUT_DIR = "rollouts"
# `--rollout-correction`'s choices: GRPO's "tis" weights a KL term PPO's loss does not have (its
# token IS is --rollout-is token --rollout-is-threshold C).
CORRECTIONS = ("decoupled",)


@dataclasses.dataclass(frozen=True)
class PPOJobConfig:
    """Everything `zeroxla ppo` needs; `ppo` holds DeepSpeed-Chat's hyper-parameters."""

    actor: str                               # a `zeroxla train` run (SFT) or its checkpoint/
    reward: str                              # a `zeroxla reward` run (or its checkpoint/), or
                                             # a HF *ForSequenceClassification directory
    prompts: str                             # {"prompt"} rows (`zeroxla.app.data_files`)
    ppo: PPOConfig = PPOConfig()
    iterations: int = 10
    inference_tp_size: int = 2
    sharding: ShardingSettings = ShardingSettings()       # the mesh (the trainer is ZeRO-3)
    run: RunSettings = RunSettings(eval_every=1)          # a line every iteration
    lora: LoRAConfig = LoRAConfig()          # actor's and critic's adapters (dim 0: none)
    rollout_corr: RolloutCorrection = RolloutCorrection()    # verl's; becomes ppo.rollout_corr
    split: str | None = None                 # a DatasetDict's split of --prompts
    rollout_correction: str | None = None    # "decoupled": AReaL's objective, not rollout_corr
    behav_imp_weight_cap: float | None = None    # its cap (None: uncapped)

    def __post_init__(self) -> None:
        check_sections(self)
        check_split(self.split, self.prompts, "--prompts")
        named, cap = self.rollout_correction, self.behav_imp_weight_cap
        if named is not None and named not in CORRECTIONS:
            raise ValueError(f"--rollout-correction {named} is invalid; accepted: "
                             f"{' | '.join(CORRECTIONS)} (token IS is --rollout-is token "
                             "--rollout-is-threshold C)")
        if cap is not None and not (isinstance(cap, (int, float)) and not isinstance(cap, bool)
                                    and cap > 1 and named == "decoupled"):
            raise ValueError(f"--behav-imp-weight-cap {cap} is invalid; accepted: none, or a "
                             "number > 1 with --rollout-correction decoupled (AReaL's: weights "
                             "above it are 0)")
        check_one_correction(named, self.rollout_corr)
        for name, value in (("iterations", self.iterations),
                            ("inference_tp_size", self.inference_tp_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PPOJobConfig.{name}={value!r} is invalid; accepted: an "
                                 "integer >= 1")
        # Each rollout is one global batch of the actor's and critic's steps.
        self.sharding.check_batch(self.ppo.prompts_per_iteration, "--per-iteration-prompts")
        self.sharding.check_packing(self.ppo.packing)

    @property
    def ppo_config(self) -> PPOConfig:
        """The trainer's config: `ppo` with the actor's rollout correction, verl's
        (`rollout_corr`) or AReaL's decoupled objective at `behav_imp_weight_cap`."""
        corr = (RolloutCorrection.decoupled(self.behav_imp_weight_cap)
                if self.rollout_correction == "decoupled" else self.rollout_corr)
        return self.ppo.replace(rollout_corr=corr)


def _ppo(flag: str, field: str, help: str, kind: Any) -> Option:
    """A row of `PPOConfig`'s (DeepSpeed-Chat's name and default where it has one)."""
    return Option(flag, flag[2:].replace("-", "_"), "ppo", field, "ppo",
                  help + "; default {default}", type=kind)


OPTIONS = OptionTable("ppo", PPOJobConfig, (
    Option("--actor", "actor", None, "actor", "job", "a zeroxla train run directory (step 1); "
           "required unless --resume", metavar="SFT_RUN", fixed=True),
    Option("--reward", "reward", None, "reward", "job", "a zeroxla reward run directory (step "
           "2), or a Hugging Face reward model directory (*ForSequenceClassification, "
           "num_labels=1, with its tokenizer); required unless --resume", metavar="RM_RUN",
           fixed=True),
    Option("--prompts", "prompts", None, "prompts", "job", f"{{\"prompt\"}} rows: {DATA_FORMS}; "
           "the prompt a string or chat messages (rendered with the actor's chat template); "
           "other columns are ignored, so a pairs file serves; required unless --resume",
           metavar="PROMPTS"),
    split_option("--prompts"),
    Option("--iterations", "iterations", None, "iterations", "job", "PPO iterations (a "
           "rollout, then --ppo-epochs steps of each model); default {default}", type=positive_int),
    Option("--inference-tp-size", "inference_tp_size", None, "inference_tp_size", "parallel",
           "tensor-parallel devices of the Hybrid Engine's rollouts: a divisor of the mesh's "
           "devices and of the actor's attention heads; default {default}", type=positive_int),
    _ppo("--actor-learning-rate", "actor_lr", "the actor's AdamW", positive_float),
    _ppo("--critic-learning-rate", "critic_lr", "the critic's AdamW", positive_float),
    _ppo("--ppo-epochs", "ppo_epochs", "steps of each model on each rollout", positive_int),
    _ppo("--max-prompt-seq-len", "prompt_length", "prompt tokens (the last ones)", positive_int),
    _ppo("--max-answer-seq-len", "answer_length", "generated tokens", positive_int),
    _ppo("--per-iteration-prompts", "prompts_per_iteration",
         "prompts per iteration (a multiple of the mesh's data replicas)", positive_int),
    _ppo("--kl-ctl", "kl_ctl", "the per-token KL penalty's weight", non_negative_float),
    _ppo("--clip-reward-value", "clip_reward_value", "the score's clip", positive_float),
    _ppo("--cliprange", "cliprange", "the policy ratio's clip", positive_float),
    _ppo("--cliprange-value", "cliprange_value", "the value clip", positive_float),
    _ppo("--gamma", "gamma", "GAE's discount", unit_interval),
    _ppo("--lam", "lam", "GAE's lambda", unit_interval),
    Option("--reference-int8", "reference_int8", "ppo", "reference_int8", "ppo",
           "the frozen reference as int8 codes of the actor's first partitions (MixZ++), "
           "dequantized per layer",
           action="store_true"),
    packing_option("ppo", "ppo", "the rollout (a prompt's left padding kept)"),
    token_budget_option("ppo", "ppo"), *named_correction_options(None, "ppo", CORRECTIONS),
    *rollout_correction_options("ppo"),
    Option("--routing-replay", "routing_replay", "ppo", "routing_replay", "ppo", "an MoE "
           "actor's routing replay (R3): measure: the rollout records each token's experts per "
           "layer (either batching) and routing/mismatch counts the pairs the actor's forward "
           "routes otherwise; on: the actor's old, the reference's and the trained log-probs "
           "also replay the record (the weights from the live router); auto (default): on for "
           "an MoE actor, off for a dense one or, with a warning naming why, where on cannot "
           "run (--no-packing, a family without routing records)",
           choices=ROUTING_REPLAY),
    Option("--rollout-dtype", "rollout_dtype", "ppo", "rollout_dtype", "ppo", "the rollout "
           "engine's dtype: bfloat16 decodes (and reshards, at half the bytes) in bf16 against "
           "the float32 masters, as verl and slime roll out; default {default}",
           choices=ROLLOUT_DTYPES),
    Option("--batch-invariant", "batch_invariant", "ppo", "batch_invariant", "ppo", "the actor "
           "(a Llama or MoE Llama family) and its reference rebuilt in the batch-invariant mode, "
           "as zeroxla grpo's: every sum in a fixed order, so at --inference-tp-size 1 the "
           "rollout's log-probs equal the actor's training forward's exactly (static batching; "
           "slower); the critic keeps the default mode", action="store_true"),
    Option("--rollout-devices", "rollout_devices", "ppo", "rollout_devices", "ppo",
           "asynchronous PPO, as zeroxla grpo's: the last N devices of --mesh generate (a "
           "rollout group) while the first ones train actor and critic; N is half the devices, "
           "0 (default) colocated (refused with LoRA, --sequence-parallel-size, "
           "--expert-parallel-size)", type=non_negative_int, metavar="N"),
    Option("--max-staleness", "max_staleness", "ppo", "max_staleness", "ppo", "with "
           "--rollout-devices: iteration i's rollout drawn from the weights of iteration >= "
           "i - k, while the update runs (0, the default: synchronous)",
           type=non_negative_int, metavar="K"),
    *(row for row in SHARDING_OPTIONS if row.flag != "--zero-stage"), *RUN_OPTIONS, *LORA_OPTIONS),
    {"job": "the runs and the prompts", "ppo": "PPO hyper-parameters (DeepSpeed-Chat's names "
     "and defaults where it has them)", "parallel": "parallelism", "run": "the run", "lora":
     "LoRA: adapters on the actor's and the critic's (not the frozen reference's) weights"},
    unit="iteration")


def _check_fit(job: PPOJobConfig, actor: Any, reward_model: Any) -> None:
    """Before any compute: prompt + answer fit both models, --inference-tp-size the mesh."""
    c, need = job.ppo, job.ppo.prompt_length + job.ppo.answer_length
    for option, path, config in (("--actor", job.actor, getattr(actor, "config", None)),
                                 ("--reward", job.reward, reward_model.base.config)):
        limit = getattr(config, "max_seq_len", None)
        if limit is not None and need > limit:
            raise ValueError(f"--max-prompt-seq-len {c.prompt_length} + --max-answer-seq-len "
                             f"{c.answer_length} = {need} tokens exceed the max_seq_len={limit} "
                             f"of {option} {path}; accepted: a sum <= {limit}")
    check_inference_tp(job.inference_tp_size, job.sharding.mesh, getattr(actor, "config", None),
                       f"--actor {job.actor}")


class _Part:
    """One model of the trainer as the runner checkpoints it: its step and its state."""

    def __init__(self, trainer: Any, name: str):
        self.trainer, self.name = trainer, name
        self.step = getattr(trainer, f"{name}_step")

    state = property(lambda self: getattr(self.trainer, f"{self.name}_state"),
                     lambda self, value: setattr(self.trainer, f"{self.name}_state", value))


class PPOJob:
    """PPO as the runner drives it (`zeroxla.app.run.job.Job`): one iteration a unit."""

    NAME: ClassVar[str] = "ppo"
    UNIT: ClassVar[str] = "iteration"
    COUNTER: ClassVar[tuple[str, int]] = ("iteration", 1)      # 0-based, as always
    EXPORT_DIR: ClassVar[str] = "actor_hf"
    PARTS: ClassVar[tuple[str, ...]] = ("actor", "critic")    # checkpoint/<part>/<n>
    DATA: ClassVar[dict[str, str]] = {"--prompts": "prompts"}
    EVALUATE_FIRST: ClassVar[bool] = False   # no held-out set: an evaluated record is printed
    label = NAME

    def __init__(self, config: PPOJobConfig):
        self.config = c = config
        mesh = c.sharding.job_mesh()
        actor, self.tokenizer = load_actor(c.actor)
        if c.ppo.batch_invariant:            # the actor's step, its engine and its reference
            actor = batch_invariant_policy(actor, "--batch-invariant", c.inference_tp_size,
                                           "--inference-tp-size")
        reward_model = load_reward(c.reward, actor, self.tokenizer)
        _check_fit(c, actor, reward_model)
        rows = chat_data.prompt_rows(
            chat_data.read_prompt_jsonl(c.prompts, c.split, self.tokenizer), self.tokenizer,
            c.ppo.prompt_length, c.prompts)
        self.critic_config = reward_model.base.config
        self.trainer = PPOTrainer(c.ppo_config, actor, mesh=mesh, tokenizer=self.tokenizer,
                                  prompt_tokens=rows, reward_model=reward_model,
                                  critic_init=reward_model, inference_tp_size=c.inference_tp_size,
                                  eos_id=getattr(self.tokenizer, "eos_id", None), seed=c.run.seed,
                                  lora=c.lora)
        self.rollouts: dict[int, Rollout] = {}     # the first and the last iteration run here

    def parts(self) -> dict[str, _Part]:
        return {name: _Part(self.trainer, name) for name in self.PARTS}

    @property
    def total(self) -> int:
        return self.config.iterations

    def describe(self, first: int) -> str:
        c, p = self.config, self.config.ppo
        return (f"zeroxla ppo: actor {c.actor}, reward model {c.reward}, "
                f"{len(self.trainer.prompt_tokens)} prompts of {p.prompt_length} tokens, answers "
                f"of up to {p.answer_length}, iterations {first}..{c.iterations - 1} "
                f"({p.prompts_per_iteration} rollouts each), ppo_epochs {p.ppo_epochs}, "
                f"routing replay {self.trainer.config.routing_replay}")

    def advance(self, done: int) -> dict[str, float]:
        record, rollout = self.trainer.iteration(done)
        first = min(self.rollouts, default=done)
        self.rollouts = {first: self.rollouts.get(first, rollout), done: rollout}
        del record["iteration"]              # the runner's COUNTER writes it
        return record

    def evaluate(self) -> dict[str, float]:
        return {}

    def say(self, record: dict[str, Any]) -> str:
        return (f"iteration {record['iteration']:>3}: reward {record['reward']:.4f}  KL "
                f"{record['kl']:.4f}  actor loss {record['actor_loss']:.4f}  critic loss "
                f"{record['critic_loss']:.4f}")

    def checkpoint_metadata(self, out: Path, part: str) -> dict[str, Any]:
        """The critic's checkpoint is a reward model's (`zeroxla export`, `load_reward_model`)."""
        del out
        return {"tokenizer": tokenizer_record(self.tokenizer),
                LORA_KEY: as_metadata(self.config.lora),
                **({"model_kind": REWARD_KIND} if part == "critic" else {})}

    def checkpoint_model_config(self, part: str) -> Any:
        return self.critic_config if part == "critic" else None     # the actor's: its own

    def restored(self, metadata: dict[str, Any]) -> None:
        del metadata                         # the reference is the --actor run's: unchanged

    def draw(self, out: Path, records: list[dict[str, Any]]) -> None:
        save_records_plot(records, out / PLOT_FILE)                 # reward and KL

    def finish(self, out: Path, records: list[dict[str, Any]],
               before: dict[str, float]) -> dict[str, Any]:
        del before
        c, written = self.config, []
        if jax.process_index() == 0:
            (out / ROLLOUT_DIR).mkdir(exist_ok=True)
            written = [str(rollout.save(out / ROLLOUT_DIR / f"{it}.npz"))
                       for it, rollout in sorted(self.rollouts.items())]
        paths = {f"{name}_checkpoint": str(part_dir(out, name) / str(int(part.state.step)))
                 for name, part in self.parts().items()}
        return {"iterations": c.iterations, "first_reward": records[0]["reward"],
                "last_reward": records[-1]["reward"], "last_kl": records[-1]["kl"],
                "time_split": time_split(records),
                "paths": {**paths, "actor_hf": str(out / self.EXPORT_DIR), "rollouts": written},
                "ppo": dataclasses.asdict(self.trainer.config), "lora": dataclasses.asdict(c.lora),
                "memory": self.trainer.memory(self.rollouts[max(self.rollouts)])}


SPEC = JobSpec(
    "ppo", help="RLHF with PPO from an SFT run and a reward model (DeepSpeed-Chat step 3)",
    description="PPO with the SFT run's model as actor and frozen reference, the critic started "
                "from the reward model, rollouts by the Hybrid Engine and rewards from the "
                "learned reward model plus the KL penalty. Writes metrics.jsonl, reward_kl.png, "
                "summary.json, checkpoint/actor, checkpoint/critic and actor_hf/ (the actor as a "
                "Hugging Face checkpoint). Ctrl-C saves the running iteration and exits 130; "
                "--resume RUN continues it.",
    table=OPTIONS, job=PPOJob, report=lambda summary: json.dumps(    # settings, ppo left out
        {k: v for k, v in finite(summary).items() if k not in ("settings", "ppo")}, indent=2),
    required={"actor": "a zeroxla train run directory", "reward": "a zeroxla reward run or a "
              "Hugging Face reward model directory", "prompts": "a prompts file"})

__all__ = ["CORRECTIONS", "OPTIONS", "PLOT_FILE", "PPOJob", "PPOJobConfig", "ROLLOUT_DIR", "SPEC"]

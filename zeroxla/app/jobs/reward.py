"""`zeroxla reward`: DeepSpeed-Chat's step 2, a reward model trained on preference pairs.

    zeroxla reward --init-from HF_DIR --data pairs.jsonl --out runs/rm

The base is a pretrained Hugging Face checkpoint (`--init-from`, loaded straight into its ZeRO
partitions; its tokenizer tokenizes the pairs); a scalar head reads its final hidden states
(`zeroxla.rlhf.RewardModel`): zero-initialised on a causal LM, or the checkpoint's own `score`
head when it is a reward model (`*ForSequenceClassification`, num_labels=1), which training
continues. The loss is `-log sigmoid(r_chosen - r_rejected)` on the scores at each answer's last
real token (`pairwise_loss_terms`); the base's unused LM output projection is frozen. With
`--lora-dim` the base gets LoRA adapters (with `--only-optimize-lora` they and the score head
alone train: `reward_trainable`). Before the first step, every `--eval-every` steps and at the
end the held-out pairs give `val_accuracy` (share with r_chosen > r_rejected), `val_margin`,
`val_loss`. Each checkpoint records the base config and tokenizer, which
`jobs.loading.load_reward_model` (and `zeroxla ppo --reward`) rebuilds; `zeroxla export` writes
it as a `*ForSequenceClassification`. The run itself is the runner's (`zeroxla.app.run`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import optax
from flax import nnx

import zeroxla
from zeroxla.app import chat_data
from zeroxla.app.cli_args import non_negative_float, positive_float, positive_int
from zeroxla.app.data import epoch_rows, split_examples, to_devices
from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer
from zeroxla.app.jobs.loading import (REWARD_KIND, init_from_head, pretrained_config,
                                      reward_model_factory, with_adapters)
from zeroxla.app.learnable import same_pairs, same_pairs_note
from zeroxla.app.run.command import JobSpec
from zeroxla.app.run.job import RunSettings, ShardingSettings, check_sections
from zeroxla.app.data_files import check_split
from zeroxla.app.run.options import (DATA_FORMS, LORA_OPTIONS, RUN_OPTIONS, SHARDING_OPTIONS,
                                     Option, OptionTable, packing_option, split_option)
from zeroxla.checkpoint.adapters import METADATA_KEY as LORA_KEY
from zeroxla.checkpoint.adapters import as_metadata
from zeroxla.checkpoint.pretrained import place, spread_hf_params
from zeroxla.lora import LoRAConfig
from zeroxla.models import hf as hf_io
from zeroxla.rlhf.packed_pairs import pack_scored_pairs
from zeroxla.rlhf.reward_model import pair_metrics, pairwise_loss_terms, reward_trainable


@dataclasses.dataclass(frozen=True)
class RewardJobConfig:
    """Everything `zeroxla reward` needs; each field is validated."""

    init_from: str                          # a HF causal LM or reward model (docs/models.md)
    data: str                               # {"prompt", "chosen", "rejected"} rows
    steps: int = 200
    val_fraction: float = 0.1
    batch_size: int = 16                    # pairs per step (global)
    seq_len: int = 64                       # prompt + answer (+ eos) tokens, right-padded
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    # As `zeroxla train`: 0 partitions every parameter (DeepSpeed's 1e5 default would keep
    # every parameter of a small model whole on each device).
    persistence_threshold: int = 0
    sharding: ShardingSettings = ShardingSettings()
    run: RunSettings = RunSettings(eval_every=50)
    lora: LoRAConfig = LoRAConfig()          # the base's adapters (dim 0: none)
    packing: bool = True                     # each step's pairs packed (`rlhf.packed_pairs`)
    split: str | None = None                 # a DatasetDict's split of --data

    def __post_init__(self) -> None:
        check_sections(self)
        check_split(self.split, self.data, "--data")
        checks = [(name, isinstance(getattr(self, name), int) and not isinstance(
            getattr(self, name), bool) and getattr(self, name) >= low, f"an integer >= {low}")
                  for name, low in (("steps", 1), ("batch_size", 1), ("seq_len", 1),
                                    ("persistence_threshold", 0))]
        checks += [("learning_rate", 0 < self.learning_rate < math.inf, "a finite positive number"),
                   ("weight_decay", 0 <= self.weight_decay < math.inf, "a finite number >= 0"),
                   ("val_fraction", 0 < self.val_fraction < 1, "a number in (0, 1)"),
                   ("packing", isinstance(self.packing, bool), "True or False")]
        for name, ok, accepted in checks:
            if not ok:
                raise ValueError(f"RewardJobConfig.{name}={getattr(self, name)!r} is invalid; "
                                 f"accepted: {accepted}")
        self.sharding.check_batch(self.batch_size, "--batch-size", self.seq_len)
        self.sharding.check_packing(self.packing)


OPTIONS = OptionTable("reward", RewardJobConfig, (
    Option("--init-from", "init_from", None, "init_from", "job",
           "a Hugging Face checkpoint directory of a family in docs/models.md (with tokenizer): "
           "a causal LM, or a reward model (*ForSequenceClassification, num_labels=1); "
           "required unless --resume", metavar="HF_DIR", fixed=True),
    Option("--data", "data", None, "data", "job",
           "preference pairs, {\"prompt\", \"chosen\", \"rejected\"} rows (strings, or TRL's "
           f"lists of messages, rendered with the checkpoint's chat template): {DATA_FORMS}; "
           "pairs with the same tokens chosen and rejected teach nothing: counted and reported, "
           "a split of only such pairs refused; required unless --resume", metavar="PAIRS"),
    split_option("--data"),
    Option("--steps", "steps", None, "steps", "job", "optimizer steps; default {default}",
           type=positive_int),
    Option("--batch-size", "batch_size", None, "batch_size", "optimizer",
           "pairs per step; default {default}", type=positive_int),
    Option("--seq-len", "seq_len", None, "seq_len", "optimizer",
           "prompt + answer tokens (a longer pair is an error, not truncated); default "
           "{default}", type=positive_int),
    Option("--learning-rate", "learning_rate", None, "learning_rate", "optimizer",
           "AdamW's; default {default}", type=positive_float, aliases=("--lr",)),
    Option("--weight-decay", "weight_decay", None, "weight_decay", "optimizer",
           "AdamW's; default {default}", type=non_negative_float),
    packing_option(None, "optimizer", "each step's pairs (a pair on one replica)"),
    *SHARDING_OPTIONS, *RUN_OPTIONS, *LORA_OPTIONS),
    {"job": "the base and the pairs", "optimizer": "training", "parallel": "parallelism",
     "run": "the run", "lora": "LoRA: adapters on the reward model's base weights"})


def initial_values(init_from: str, config: Any, mesh: Any, *,
                   progress: bool = True) -> dict[str, Any]:
    """The reward model's parameters from the HF checkpoint `init_from`, spread over `mesh`
    (`step.init_from` lays them out): a causal LM's under `base/` with a zero `v_head`
    (DeepSpeed-Chat's fresh head), or a reward model's own, `score.weight` as `v_head`."""
    head = init_from_head(init_from, "zeroxla reward")
    if head == hf_io.SEQUENCE_CLASSIFICATION:
        return spread_hf_params(config, init_from, mesh, progress=progress, head=head)
    values = {f"{hf_io.REWARD_BASE}/{path}": value for path, value in spread_hf_params(
        config, init_from, mesh, progress=progress).items()}
    values[hf_io.REWARD_SCORE] = place(np.zeros((config.d_model,), np.float32), mesh, np.float32)
    return values


def pair_rows(job: RewardJobConfig, tokenizer: PretrainedTokenizer) -> tuple[dict, dict, int]:
    """(train, val) pair arrays and how many pairs have no preference (chosen = rejected
    tokens), every error (file:line, a pair that does not fit, nothing to learn) first."""
    train, val = split_examples(chat_data.read_pair_jsonl(job.data, job.split),
                                job.val_fraction, job.run.seed)
    if len(train) < job.batch_size:
        raise ValueError(f"--batch-size {job.batch_size} exceeds the {len(train)} training "
                         f"pairs of {job.data}; accepted: --batch-size <= {len(train)}")
    arrays = [chat_data.pair_arrays(part, tokenizer, job.seq_len, eos_id=tokenizer.eos_id)
              for part in (train, val)]
    same = same_pairs(f"--data {job.data}", {"training": arrays[0], "validation": arrays[1]},
                      "one score for both: the pairwise loss is log 2 with a zero gradient")
    return arrays[0], arrays[1], same


class RewardJob:
    """Step 2 as the runner drives it (`zeroxla.app.run.job.Job`): one optimizer step a unit."""

    NAME: ClassVar[str] = "reward"
    UNIT: ClassVar[str] = "step"
    COUNTER: ClassVar[tuple[str, int]] = ("step", 0)
    EXPORT_DIR: ClassVar[None] = None        # `zeroxla export` writes a reward checkpoint
    PARTS: ClassVar[tuple[None]] = (None,)
    DATA: ClassVar[dict[str, str]] = {"--data": "data"}
    EVALUATE_FIRST: ClassVar[bool] = True    # the step 0 record: a zero head ties every pair

    def __init__(self, config: RewardJobConfig):
        self.config = c = config
        self.label = f"reward-{Path(c.init_from).name}"     # runs/reward-<base>-<time>
        mesh = c.sharding.job_mesh()
        self.tokenizer = PretrainedTokenizer.from_dir(c.init_from)
        self.model_config = pretrained_config(c.init_from, self.tokenizer, c.seq_len,
                                              command="zeroxla reward")
        self.train, self.val, self.same = pair_rows(c, self.tokenizer)
        factory = reward_model_factory(self.model_config, c.run.seed, c.lora)
        zero = zeroxla.ZeroConfig(stage=c.sharding.stage, check_grad_overflow=True,
                                  persistence_threshold=c.persistence_threshold,
                                  sequence_parallel_size=c.sharding.sequence_parallel_size)
        self.step = zeroxla.make_step(
            factory, mesh, loss_fn=pairwise_loss_terms, config=zero,
            optimizer=optax.adamw(c.learning_rate, weight_decay=c.weight_decay),
            trainable=reward_trainable(c.lora.only_optimize_lora))
        values = initial_values(c.init_from, self.model_config, mesh, progress=c.run.progress)
        if c.lora.enabled:
            values = with_adapters(values, factory, mesh)
        self.state = self.step.init_from(values, c.run.seed)

    def parts(self) -> dict[None, "RewardJob"]:
        return {None: self}

    @property
    def total(self) -> int:
        return self.config.steps

    def describe(self, first: int) -> str:
        c = self.config
        return (f"zeroxla reward: {c.init_from} + scalar head on {c.data} "
                f"({len(self.train['chosen'])} train / {len(self.val['chosen'])} val pairs"
                f"{same_pairs_note(self.same)}), {c.sharding.describe()}, batch "
                f"{c.batch_size} pairs x {c.seq_len}, steps {first + 1}..{c.steps}"
                + (f", LoRA rank {c.lora.dim}" if c.lora.enabled else ""))

    def advance(self, done: int) -> dict[str, float]:
        c, layout = self.config, self.step.layout
        rows = epoch_rows(self.train, c.batch_size, done, c.run.seed)
        if c.packing:                  # the same loss without the padding (`packed_pairs`)
            rows = pack_scored_pairs(rows, row_len=c.seq_len, data_size=layout.data_size)[0]
        self.state, metrics = self.step(self.state, to_devices(rows, layout.batch_sharding))
        return {"loss": float(metrics["loss"])}

    def evaluate(self) -> dict[str, float]:
        model = zeroxla.gathered_model(self.state)
        metrics = pair_metrics(model, self.val)
        total, count = nnx.jit(pairwise_loss_terms)(
            model, {k: np.asarray(v) for k, v in self.val.items()})
        return {f"val_{k}": v for k, v in metrics.items()} | {"val_loss": float(total / count)}

    def say(self, record: dict[str, Any]) -> str:
        return (f"step {record['step']:>5}: loss {record['loss']:.4f}  validation accuracy "
                f"{record['val_accuracy']:.3f}  margin {record['val_margin']:.3f}")

    def checkpoint_metadata(self, out: Path, part: None) -> dict[str, Any]:
        del out
        return {"model_kind": REWARD_KIND, "init_from": str(self.config.init_from),
                "tokenizer": self.tokenizer.record(), LORA_KEY: as_metadata(self.config.lora)}

    def checkpoint_model_config(self, part: None) -> Any:
        return self.model_config      # the base's: what `load_reward_model` and export rebuild

    def restored(self, metadata: dict[str, Any]) -> None:
        del metadata                  # the state is all a step reads

    def draw(self, out: Path, records: list[dict[str, Any]]) -> None:
        del out, records              # the reward job draws nothing

    def finish(self, out: Path, records: list[dict[str, Any]],
               before: dict[str, float]) -> dict[str, Any]:
        del out, before               # the start's evaluation is the step 0 record
        last = records[-1]
        return {"steps": self.config.steps, "first_val_accuracy": records[0]["val_accuracy"],
                **{k: v for k, v in last.items() if k.startswith("val_")},
                "final_train_loss": last["loss"], "pairs_without_preference": self.same}


SPEC = JobSpec(
    "reward", help="train a reward model on preference pairs (DeepSpeed-Chat step 2)",
    description="A pretrained Hugging Face checkpoint (--init-from) plus a scalar head (a causal "
                "LM gets a zero one; a *ForSequenceClassification reward model with num_labels=1 "
                "keeps its own), trained with -log sigmoid(r_chosen - r_rejected) on the end "
                "scores of {\"prompt\", \"chosen\", \"rejected\"} JSONL pairs under ZeRO. Writes "
                "metrics.jsonl (loss; validation accuracy and margin), summary.json and "
                "checkpoint/ (read by zeroxla ppo --reward; zeroxla export writes it as a "
                "*ForSequenceClassification). Ctrl-C saves the running step and exits 130; a "
                "non-finite loss stops the run (exit 1) keeping its last finite checkpoint; "
                "--resume RUN continues it.",
    table=OPTIONS, job=RewardJob,
    required={"init_from": "a Hugging Face causal LM or reward model directory",
              "data": "a preference pairs file"})

__all__ = ["OPTIONS", "RewardJob", "RewardJobConfig", "SPEC", "initial_values", "pair_rows"]

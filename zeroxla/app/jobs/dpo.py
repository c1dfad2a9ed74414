"""`zeroxla dpo`: Direct Preference Optimization of a causal LM on preference pairs.

    zeroxla dpo --init-from HF_DIR_OR_RUN [--data pairs.jsonl] --steps N --out runs/dpo

The policy starts from `--init-from` (a Hugging Face causal LM directory with its tokenizer, or
a `zeroxla train` run, e.g. an SFT run; `jobs.loading.open_policy`), and so does the frozen
reference, whose log-probs of every pair are computed once before the first step
(`zeroxla.rlhf.DPOTrainer`). Each record of `--data` holds
`prompt`, `chosen` and `rejected` (`chat_data.read_pair_jsonl`); without --data, the
tiny-shakespeare pairs of `chat_data.shakespeare_pairs` (true next line chosen, its letters
scrambled rejected). Every step's record holds `loss`, `accuracy`, `margin` of the step's pairs;
every `--eval-every` steps, before the first and at the end the held-out pairs add `val_loss`,
`val_accuracy`, `val_margin`. With `--lora-dim` the policy trains LoRA adapters (the reference
stays the plain starting model) and policy_hf/ is the merged model. The run itself
(checkpoints, signals, resume, export to policy_hf/) is the runner's (`zeroxla.app.run`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

import zeroxla
from zeroxla.app import chat_data
from zeroxla.app.cli_args import positive_float, positive_int
from zeroxla.app.jobs.loading import BASE_KEY, adapters_base, open_policy
from zeroxla.app.learnable import same_pairs, same_pairs_note
from zeroxla.app.run.command import JobSpec
from zeroxla.app.run.job import RunSettings, ShardingSettings, check_sections
from zeroxla.app.data_files import check_split
from zeroxla.app.run.options import (DATA_FORMS, LORA_OPTIONS, RUN_OPTIONS, SHARDING_OPTIONS,
                                     Option, OptionTable, packing_option, split_option)
from zeroxla.app.tokenizers.records import tokenizer_record
from zeroxla.app.data import split_examples
from zeroxla.checkpoint.adapters import METADATA_KEY as LORA_KEY
from zeroxla.checkpoint.adapters import as_metadata
from zeroxla.lora import LoRAConfig
from zeroxla.rlhf.dpo.losses import LOSS_TYPES, DPOConfig, pair_batch
from zeroxla.rlhf.dpo.trainer import DPOTrainer

BUNDLED_PAIRS = 512                    # shakespeare pairs without --data


@dataclasses.dataclass(frozen=True)
class DPOJobConfig:
    """Everything `zeroxla dpo` needs; `dpo` holds DPO's hyper-parameters."""

    init_from: str
    data: str | None = None                  # None: the bundled shakespeare pairs
    steps: int = 100
    val_fraction: float = 0.1
    dpo: DPOConfig = DPOConfig()
    sharding: ShardingSettings = ShardingSettings()
    run: RunSettings = RunSettings(eval_every=20)
    lora: LoRAConfig = LoRAConfig()          # the policy's adapters (dim 0: none)
    split: str | None = None                 # a DatasetDict's split of --data

    def __post_init__(self) -> None:
        check_sections(self)
        check_split(self.split, self.data, "--data")
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1:
            raise ValueError(f"DPOJobConfig.steps={self.steps!r} is invalid; accepted: an "
                             "integer >= 1")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"DPOJobConfig.val_fraction={self.val_fraction!r} is invalid; "
                             "accepted: a number in (0, 1)")
        # (no --seq-len check: the model reads seq_len - 1 tokens of a pair, packed into rows
        # rounded up to a multiple of --sequence-parallel-size)
        self.sharding.check_packing(self.dpo.packing)
        self.sharding.check_batch(self.dpo.batch_size, "--batch-size")


OPTIONS = OptionTable("dpo", DPOJobConfig, (
    Option("--init-from", "init_from", None, "init_from", "job",
           "a Hugging Face causal LM directory (with tokenizer) or a zeroxla train run "
           "directory; required unless --resume", metavar="HF_DIR_OR_RUN", fixed=True),
    Option("--data", "data", None, "data", "job",
           "preference pairs, {\"prompt\", \"chosen\", \"rejected\"} rows (strings, or TRL's "
           f"lists of messages, rendered with the checkpoint's chat template): {DATA_FORMS}; "
           "default: the bundled tiny-shakespeare pairs (true next line vs. its letters "
           "scrambled). Pairs whose chosen and rejected are the same tokens teach nothing: they "
           "are counted and reported, and a file (or its train or validation split) of only "
           "such pairs is refused", metavar="PAIRS"),
    split_option("--data"),
    Option("--steps", "steps", None, "steps", "job", "optimizer steps; default {default}",
           type=positive_int),
    Option("--beta", "beta", "dpo", "beta", "dpo",
           "the KL strength: rewards are beta x (policy - reference) log-ratios; default "
           "{default}", type=positive_float),
    Option("--loss-type", "loss_type", "dpo", "loss_type", "dpo", "default {default}",
           choices=LOSS_TYPES),
    Option("--learning-rate", "learning_rate", "dpo", "learning_rate", "dpo",
           "AdamW's; default {default}", type=positive_float),
    Option("--batch-size", "batch_size", "dpo", "batch_size", "dpo",
           "pairs per step; default {default}", type=positive_int),
    Option("--seq-len", "seq_len", "dpo", "seq_len", "dpo",
           "prompt + answer tokens (a longer pair is an error, not truncated); default "
           "{default}", type=positive_int),
    Option("--reference-int8", "reference_int8", "dpo", "reference_int8", "dpo",
           "the frozen reference as int8 codes of the policy's first partitions (MixZ++), "
           "dequantized per layer",
           action="store_true"),
    packing_option("dpo", "dpo", "each step's pairs (a pair on one replica; held-out pairs "
                   "stay padded)"),
    *SHARDING_OPTIONS, *RUN_OPTIONS, *LORA_OPTIONS),
    {"job": "the policy and the pairs", "dpo": "DPO hyper-parameters (TRL's DPOConfig names)",
     "parallel": "parallelism", "run": "the run",
     "lora": "LoRA: adapters on the policy's (not the frozen reference's) weights"})


def pair_rows(job: DPOJobConfig, tokenizer: Any) -> tuple[dict, dict, int]:
    """(train, val) `dpo.pair_batch` rows of `--data` (or the bundled pairs) and how many pairs
    have the same chosen and rejected tokens: kept and counted as `zeroxla reward` does
    (`learnable.same_pairs`), refused when they are all of the file or of a split.

    Each row's sum runs over the tokens after the longest prefix the chosen and rejected rows
    share: the prompt, and any first answer tokens both answers begin with. A shared token has
    the same log-prob in both rows (same context, causal model) under the policy and under the
    reference, so it cancels in every DPO quantity (loss, margin, accuracy); the boundary needs
    no knowledge of where a chat template ends the prompt."""
    seed = job.run.seed
    examples = (chat_data.read_pair_jsonl(job.data, job.split) if job.data is not None
                else chat_data.shakespeare_pairs(BUNDLED_PAIRS, seed=seed))
    source = f"--data {job.data}" if job.data else "the bundled shakespeare pairs"
    splits = {name: chat_data.pair_arrays(part, tokenizer, job.dpo.seq_len,
                                          eos_id=getattr(tokenizer, "eos_id", None))
              for name, part in zip(("training", "validation"),
                                    split_examples(examples, job.val_fraction, seed))}
    same = same_pairs(source, splits, "one log-ratio for both: the DPO loss is constant with a "
                                      "zero gradient")
    parts = []
    for arrays in splits.values():
        shared = np.argmax(arrays["chosen"] != arrays["rejected"], axis=1)      # [N]
        parts.append(pair_batch(arrays, {"chosen": shared, "rejected": shared}))
    return parts[0], parts[1], same


class DPOJob:
    """DPO as the runner drives it (`zeroxla.app.run.job.Job`): one optimizer step a unit."""

    NAME: ClassVar[str] = "dpo"
    UNIT: ClassVar[str] = "step"
    COUNTER: ClassVar[tuple[str, int]] = ("step", 0)
    EXPORT_DIR: ClassVar[str] = "policy_hf"
    PARTS: ClassVar[tuple[None]] = (None,)
    DATA: ClassVar[dict[str, str]] = {"--data": "data"}
    EVALUATE_FIRST: ClassVar[bool] = True
    label = NAME

    def __init__(self, config: DPOJobConfig):
        self.config = config
        # a --mesh larger than the devices: refused
        mesh = config.sharding.job_mesh()
        self.tokenizer, load = open_policy(config.init_from, config.dpo.seq_len, config.lora)
        train, val, self.same = pair_rows(config, self.tokenizer)
        zero = zeroxla.ZeroConfig(stage=config.sharding.stage, persistence_threshold=0,
                                  check_grad_overflow=True,
                                  sequence_parallel_size=config.sharding.sequence_parallel_size)
        self.trainer = DPOTrainer(config.dpo, load(), mesh=mesh, train=train, val=val,
                                  seed=config.run.seed, zero_config=zero, lora=config.lora)
        self.step = self.trainer.step

    @property
    def state(self) -> Any:
        return self.trainer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.trainer.state = value

    def parts(self) -> dict[None, "DPOJob"]:
        return {None: self}

    @property
    def total(self) -> int:
        return self.config.steps

    def describe(self, first: int) -> str:
        c, n = self.config, len(self.trainer.train["chosen"])
        return (f"zeroxla dpo: {c.init_from} on {c.data or 'the bundled shakespeare pairs'} "
                f"({n} train / {len(self.trainer.val['chosen'])} held-out pairs"
                f"{same_pairs_note(self.same)}), {c.dpo.loss_type} loss, beta {c.dpo.beta}, "
                f"{c.sharding.describe()}, steps {first + 1}..{c.steps}"
                + (f", LoRA rank {c.lora.dim}" if c.lora.enabled else ""))

    def advance(self, done: int) -> dict[str, float]:
        record = self.trainer.step_record(done)
        del record["step"]
        return record

    def evaluate(self) -> dict[str, float]:
        return self.trainer.evaluate()

    def say(self, record: dict[str, Any]) -> str:
        return (f"step {record['step']:>5}: loss {record['loss']:.4f}  accuracy "
                f"{record['accuracy']:.3f}  margin {record['margin']:.4f}  | held-out loss "
                f"{record['val_loss']:.4f}  accuracy {record['val_accuracy']:.3f}  margin "
                f"{record['val_margin']:.4f}")

    def checkpoint_metadata(self, out: Path, part: None) -> dict[str, Any]:
        del out
        return {"tokenizer": tokenizer_record(self.tokenizer),
                LORA_KEY: as_metadata(self.config.lora),
                BASE_KEY: adapters_base(self.config.init_from)}

    def checkpoint_model_config(self, part: None) -> None:
        return None                   # the policy's own

    def restored(self, metadata: dict[str, Any]) -> None:
        del metadata                  # the reference sums are the starting model's: unchanged

    def draw(self, out: Path, records: list[dict[str, Any]]) -> None:
        del out, records              # DPO draws nothing

    def finish(self, out: Path, records: list[dict[str, Any]],
               before: dict[str, float]) -> dict[str, Any]:
        del out, before               # the start's evaluation is the step 0 record
        return {"steps": self.config.steps, "first_val_accuracy": records[0]["val_accuracy"],
                **{k: v for k, v in records[-1].items() if k != "step"},
                "reference_bytes": self.trainer.reference_bytes,
                "pairs_without_preference": self.same}


SPEC = JobSpec(
    "dpo", help="Direct Preference Optimization of a causal LM on preference pairs",
    description="DPO (Rafailov et al. 2023; IPO with --loss-type ipo) of a Hugging Face causal "
                "LM or a zeroxla train run on {\"prompt\", \"chosen\", \"rejected\"} pairs under "
                "ZeRO, against a frozen reference (the starting model), whose log-probs are "
                "computed once. Writes metrics.jsonl (loss, accuracy, margin per step; held-out "
                "val_* every --eval-every steps), summary.json, checkpoint/ and policy_hf/ (the "
                "policy as a Hugging Face checkpoint, LoRA adapters merged). Ctrl-C saves the "
                "running step and exits 130; a non-finite loss stops the run (exit 1) keeping "
                "its last finite checkpoint; --resume RUN continues it.",
    table=OPTIONS, job=DPOJob,
    required={"init_from": "a Hugging Face causal LM directory or a zeroxla train run"})

__all__ = ["BUNDLED_PAIRS", "DPOJob", "DPOJobConfig", "OPTIONS", "SPEC", "pair_rows"]

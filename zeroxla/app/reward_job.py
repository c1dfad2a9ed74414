"""`zeroxla reward`: DeepSpeed-Chat's step 2, a reward model trained on preference pairs.

    zeroxla reward --init-from HF_DIR --data pairs.jsonl --out runs/rm

The base is a pretrained Hugging Face checkpoint (`--init-from`: its weights are loaded straight
into their ZeRO partitions, its tokenizer tokenizes the pairs); a scalar head reads its final
hidden states (`zeroxla.rlhf.RewardModel`): zero-initialised on a causal LM, or the checkpoint's
own `score` head when it is a reward model (`*ForSequenceClassification`, num_labels=1: one
downloaded, or exported by `zeroxla export`), which training continues. Each record of `--data`
(JSON lines, or a .json array) holds `prompt`, `chosen` and `rejected`; the loss is
`-log sigmoid(r_chosen - r_rejected)` on the scores at each answer's last real token
(`pairwise_loss_terms`), the base's unused LM output projection is frozen. With `--lora-dim`,
the base gets LoRA adapters (`zeroxla.lora`; with `--only-optimize-lora` they and the score
head alone train: `trainable_filter`), merged when the run is loaded. Every `eval_every`
steps and at the end, the held-out pairs give `val_accuracy` (share with r_chosen >
r_rejected), `val_margin` and `val_loss`.

The run directory holds metrics.jsonl, summary.json and checkpoint/<step>/, a ZeRO checkpoint
of the reward model recording its base config and tokenizer, which `load_reward_model` (and
`zeroxla ppo --reward`) rebuilds; `zeroxla export` writes it as a `*ForSequenceClassification`.
Everything that can be refused (options, mesh, pairs, an --out that holds a run) is refused
before the directory is made; a run that fails after that removes what it wrote.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import optax
from flax import nnx

import zeroxla
from zeroxla import checkpoint, models
from zeroxla.app import chat_data, rundir
from zeroxla.app.hf_tokenizer import PretrainedTokenizer
from zeroxla.app.learnable import same_pairs, same_pairs_note
from zeroxla.app.train.model import init_from_head, pretrained_config, with_adapters
from zeroxla.app.train.lora import add_adapters
from zeroxla.app.train.report import parameter_counts
from zeroxla.app.cli_args import check_batch
from zeroxla.app.distributed import job_mesh
from zeroxla.app.tokenizer_records import tokenizer_from_record
from zeroxla.app.train.data import epoch_rows, split_examples, to_devices
from zeroxla.checkpoint.adapters import METADATA_KEY as LORA_KEY
from zeroxla.checkpoint.adapters import as_metadata, recorded_lora
from zeroxla.checkpoint.pretrained import place, spread_hf_params
from zeroxla.lora import LoRAConfig, fuse_lora_weight
from zeroxla.models import hf as hf_io
from zeroxla.rlhf.reward_model import (RewardModel, load_hf_reward_model, pair_metrics,
                                       pairwise_loss_terms, without_lm_head)

KIND = "zeroxla.rlhf.RewardModel"      # the checkpoint metadata's "model_kind"


@dataclasses.dataclass(frozen=True)
class RewardJobConfig:
    """Everything `zeroxla reward` needs; each field is validated."""

    init_from: str                          # a HF causal LM or reward model (docs/models.md)
    data: str                               # a .jsonl of {"prompt", "chosen", "rejected"}
    steps: int = 200
    batch_size: int = 16                    # pairs per step (global)
    seq_len: int = 64                       # prompt + answer (+ eos) tokens, right-padded
    lr: float = 1e-3
    weight_decay: float = 0.0
    mesh: tuple[int, int] = (2, 4)
    zero_stage: int = 3
    # As `zeroxla train`: 0 partitions every parameter (DeepSpeed's 1e5 default would keep
    # every parameter of a small model whole on each device).
    persistence_threshold: int = 0
    eval_every: int = 50
    val_fraction: float = 0.1
    seed: int = 0
    out_dir: str | None = None              # None: runs/reward-<base>-<time>
    progress: bool = True
    lora: LoRAConfig = LoRAConfig()          # the base's adapters (dim 0: none)

    def __post_init__(self) -> None:
        def fail(name: str, accepted: str) -> None:
            raise ValueError(f"RewardJobConfig.{name}={getattr(self, name)!r} is invalid; "
                             f"accepted: {accepted}")

        for name in ("steps", "batch_size", "seq_len", "eval_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                fail(name, "an integer >= 1")
        if not 0 < self.lr < math.inf:
            fail("lr", "a finite positive number")
        if not 0 <= self.weight_decay < math.inf:
            fail("weight_decay", "a finite number >= 0")
        if self.zero_stage not in (0, 1, 2, 3):
            fail("zero_stage", "0, 1, 2 or 3")
        if not 0 < self.val_fraction < 1:
            fail("val_fraction", "a number in (0, 1)")
        if len(self.mesh) != 2 or not all(isinstance(n, int) and n >= 1 for n in self.mesh):
            fail("mesh", "(nodes, local) with both >= 1, e.g. (2, 4)")
        check_batch(self.batch_size, "--batch-size", self.mesh)
        if not isinstance(self.lora, LoRAConfig):
            fail("lora", "a zeroxla.lora.LoRAConfig")


def reward_model_factory(config: Any, seed: int = 0,
                         lora: LoRAConfig = LoRAConfig()) -> Callable[[], RewardModel]:
    """A zero-arg factory of `RewardModel(base)` for a models config (for `make_step` and
    `load_params`), with `lora`'s adapters on the base when it is enabled."""
    cls = models.model_class(config)

    def build() -> RewardModel:
        rngs = nnx.Rngs(seed)
        model = RewardModel(cls(config, rngs=rngs))
        if lora.enabled:
            add_adapters(model, lora, rngs)
        return model
    return build


def trainable_filter(lora: LoRAConfig) -> Any:
    """`make_step`'s trainable filter: every parameter but the unread LM head; with
    `only_optimize_lora`, the adapters and the score head `v_head` (a fresh zero head has to
    learn: with it frozen, no gradient would reach the adapters)."""
    if lora.only_optimize_lora:
        return nnx.Any(nnx.LoRAParam, nnx.PathContains(hf_io.REWARD_SCORE))
    return without_lm_head


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


def _pairs(job: RewardJobConfig, tokenizer: PretrainedTokenizer) -> tuple[dict, dict, int]:
    """(train, val) pair arrays and how many pairs have no preference (chosen = rejected
    tokens), every error (file:line, a pair that does not fit, nothing to learn) first."""
    train, val = split_examples(chat_data.read_pair_jsonl(job.data), job.val_fraction, job.seed)
    if len(train) < job.batch_size:
        raise ValueError(f"--batch-size {job.batch_size} exceeds the {len(train)} training "
                         f"pairs of {job.data}; accepted: --batch-size <= {len(train)}")
    arrays = [chat_data.pair_arrays(part, tokenizer, job.seq_len, eos_id=tokenizer.eos_id)
              for part in (train, val)]
    same = same_pairs(f"--data {job.data}", {"training": arrays[0], "validation": arrays[1]},
                      "one score for both: the pairwise loss is log 2 with a zero gradient")
    return arrays[0], arrays[1], same


def _validate(state: Any, val: dict) -> dict[str, float]:
    model = zeroxla.gathered_model(state)
    metrics = pair_metrics(model, val)
    total, count = nnx.jit(pairwise_loss_terms)(model, {k: np.asarray(v) for k, v in val.items()})
    return {f"val_{k}": v for k, v in metrics.items()} | {"val_loss": float(total / count)}


def _train(job: RewardJobConfig, step: Any, state: Any, train: dict, val: dict, out: Path,
           write: Callable[[str], None]) -> tuple[Any, list[dict]]:
    """The steps, with metrics.jsonl written as they go; returns the state and the records."""
    from tqdm import tqdm

    records = [{"step": 0, **_validate(state, val)}]
    with open(out / rundir.METRICS_FILE, "w", encoding="utf-8") as f, \
            tqdm(total=job.steps, desc="reward", unit="step", disable=not job.progress) as bar:
        f.write(json.dumps(records[0]) + "\n")
        for k in range(job.steps):
            batch = to_devices(epoch_rows(train, job.batch_size, k, job.seed),
                               step.layout.batch_sharding)
            state, metrics = step(state, batch)
            record = {"step": k + 1, "loss": float(metrics["loss"])}
            if (k + 1) % job.eval_every == 0 or k + 1 == job.steps:
                record.update(_validate(state, val))
                write(f"step {k + 1:>5}: loss {record['loss']:.4f}  validation accuracy "
                      f"{record['val_accuracy']:.3f}  margin {record['val_margin']:.3f}")
            records.append(record)
            f.write(json.dumps(record) + "\n")
            bar.set_postfix_str(f"loss {record['loss']:.3f}", refresh=False)
            bar.update()
    return state, records


def run(job: RewardJobConfig, *, write: Callable[[str], None] = print) -> dict[str, Any]:
    """Trains the reward model as `job` says; returns the summary (also in summary.json). A
    run that fails, or is interrupted, removes what it wrote to its directory (nothing in it
    could be continued: `zeroxla reward` has no --resume)."""
    start = time.perf_counter()
    mesh = job_mesh(job.mesh)                # a --mesh larger than the devices is refused here
    tokenizer = PretrainedTokenizer.from_dir(job.init_from)
    config = pretrained_config(job.init_from, tokenizer, job.seq_len, command="zeroxla reward")
    train, val, same = _pairs(job, tokenizer)
    out = Path(job.out_dir) if job.out_dir else rundir.default_run_dir(
        f"reward-{Path(job.init_from).name}", now=datetime.datetime.now())
    rundir.check_out_dir(out, resuming=None, resumable=False)

    factory = reward_model_factory(config, job.seed, job.lora)
    step = zeroxla.make_step(
        factory, mesh, loss_fn=pairwise_loss_terms,
        optimizer=optax.adamw(job.lr, weight_decay=job.weight_decay),
        config=zeroxla.ZeroConfig(stage=job.zero_stage,
                                  persistence_threshold=job.persistence_threshold),
        trainable=trainable_filter(job.lora))
    values = initial_values(job.init_from, config, mesh, progress=job.progress)
    if job.lora.enabled:
        values = with_adapters(values, factory, mesh)
    state = step.init_from(values, job.seed)
    write(f"zeroxla reward: {job.init_from} + scalar head on {job.data} ({len(train['chosen'])} "
          f"train / {len(val['chosen'])} val pairs"
          + same_pairs_note(same)
          + f"), ZeRO-{job.zero_stage} on a {job.mesh[0]}x{job.mesh[1]} mesh, batch "
          f"{job.batch_size} pairs x {job.seq_len}")

    with rundir.job_directory(out, fresh=job.out_dir is None):
        state, records = _train(job, step, state, train, val, out, write)
        path = checkpoint.save(out / rundir.CHECKPOINT_DIR, state, layout=step.layout,
                               model_config=config,
                               metadata={"model_kind": KIND, "init_from": str(job.init_from),
                                         "tokenizer": tokenizer.record(),
                                         LORA_KEY: as_metadata(job.lora)})
        last = records[-1]
        summary = {"steps": job.steps, "first_val_accuracy": records[0]["val_accuracy"],
                   **{k: v for k, v in last.items() if k.startswith("val_")},
                   "final_train_loss": last["loss"], "checkpoint": str(path),
                   "pairs_without_preference": same,
                   "parameters": parameter_counts(step.layout),
                   "wall_time_s": time.perf_counter() - start,
                   "settings": {**dataclasses.asdict(job), "mesh": list(job.mesh),
                                "lora": dataclasses.asdict(job.lora)}}
        (out / rundir.SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def load_reward_model(run_dir: str | Path) -> tuple[RewardModel, Any]:
    """(plain RewardModel with the trained weights, a LoRA run's adapters merged, tokenizer) of
    a `zeroxla reward` run (its directory, or its checkpoint/ directory), or of a HF reward
    model directory (config.json: a `*ForSequenceClassification` with num_labels=1, and its
    tokenizer)."""
    run_dir = Path(run_dir)
    if (run_dir / "config.json").is_file():
        return load_hf_reward_model(run_dir), PretrainedTokenizer.from_dir(run_dir)
    directory = rundir.checkpoint_dir_of(run_dir)
    meta = checkpoint.read_metadata(directory)
    if meta["metadata"].get("model_kind") != KIND:
        raise ValueError(f"{run_dir} is not a `zeroxla reward` run: its checkpoint records "
                         f"model_kind={meta['metadata'].get('model_kind')!r}, not {KIND!r}")
    config = checkpoint.model_config_from_record(meta["model_config"])
    lora = recorded_lora(meta) or LoRAConfig()
    model = zeroxla.load_params(directory, model=reward_model_factory(config, lora=lora))
    tokenizer = tokenizer_from_record(meta["metadata"]["tokenizer"])
    return (fuse_lora_weight(model) if lora.enabled else model), tokenizer


__all__ = ["KIND", "RewardJobConfig", "initial_values", "load_reward_model", "reward_model_factory",
           "run", "trainable_filter"]

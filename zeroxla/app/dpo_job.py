"""`zeroxla dpo`: Direct Preference Optimization of a causal LM on preference pairs.

    zeroxla dpo --init-from HF_DIR_OR_RUN [--data pairs.jsonl] --steps N --out runs/dpo

The policy starts from `--init-from` (a Hugging Face causal LM directory with its tokenizer, or
a `zeroxla train` run, e.g. an SFT run), and so does the frozen reference, whose log-probs of
every pair are computed once before the first step (`zeroxla.rlhf.DPOTrainer`; int8 with
--reference-int8). Each record of `--data` holds `prompt`, `chosen` and `rejected`
(`chat_data.read_pair_jsonl`); without --data, the tiny-shakespeare pairs of
`chat_data.shakespeare_pairs` (true next line chosen, its letters scrambled rejected). The
policy trains under ZeRO (`make_step` with the DPO loss_fn); every step writes its record
(`loss`, `accuracy`, `margin` of the step's pairs), every `eval_every` steps and at the end the
held-out pairs add `val_loss`, `val_accuracy`, `val_margin`.

The run directory holds metrics.jsonl, summary.json, checkpoint/<step>/ (every `save_every`
steps, at the end, and at Ctrl-C or SIGTERM: the running step finishes and is saved, and the
job exits with the signal's status) and policy_hf/, the trained policy as a Hugging Face
checkpoint with its tokenizer. With `--lora-dim` (`zeroxla train`'s LoRA options) the policy
trains LoRA adapters (the reference stays the plain starting model); the checkpoint records
them, policy_hf/ is the merged model, and summary.json's "parameters" counts what trains. A
`zeroxla train` (or dpo) run given to --init-from is read merged. `--resume RUN` continues a run from its newest checkpoint with
the settings it recorded (`--steps` may extend it): step k sees the same pairs either way. A
run that fails before its first checkpoint removes what it wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

import zeroxla
from zeroxla import checkpoint
from zeroxla.app import chat_data, rundir
from zeroxla.app.cli_args import check_batch
from zeroxla.app.distributed import job_mesh
from zeroxla.app.hf_tokenizer import PretrainedTokenizer, save_tokenizer
from zeroxla.app.interrupt import STOP_SIGNALS, stop_requests
from zeroxla.app.learnable import same_pairs, same_pairs_note
from zeroxla.app.tokenizer_records import tokenizer_from_record, tokenizer_record
from zeroxla.app.train.data import split_examples
from zeroxla.app.train.lora import BASE_KEY, adapters_base
from zeroxla.app.train.model import check_adapters, load_trained
from zeroxla.app.train.report import parameter_counts
from zeroxla.checkpoint.adapters import METADATA_KEY as LORA_KEY
from zeroxla.checkpoint.adapters import as_metadata
from zeroxla.checkpoint.export import export_checkpoint
from zeroxla.lora import LoRAConfig
from zeroxla.models import hf as hf_io
from zeroxla.rlhf.dpo import DPOConfig, pair_batch
from zeroxla.rlhf.dpo_trainer import DPOTrainer

KIND = "zeroxla.rlhf.dpo"              # the checkpoint metadata's "job_kind"
EXPORT_DIR = "policy_hf"
BUNDLED_PAIRS = 512                    # shakespeare pairs without --data
INIT_ACCEPTED = ("a Hugging Face causal LM directory (config.json, safetensors, tokenizer) or a "
                 "`zeroxla train` run directory (or its checkpoint/)")


@dataclasses.dataclass(frozen=True)
class DPOJobConfig:
    """Everything `zeroxla dpo` needs; `dpo` holds DPO's hyper-parameters."""

    init_from: str
    data: str | None = None                  # None: the bundled shakespeare pairs
    dpo: DPOConfig = DPOConfig()
    steps: int = 100
    mesh: tuple[int, int] = (2, 4)
    zero_stage: int = 3
    eval_every: int = 20
    save_every: int = 0                      # 0: only at the end (and at a stop signal)
    val_fraction: float = 0.1
    seed: int = 0
    out_dir: str | None = None
    progress: bool = True
    lora: LoRAConfig = LoRAConfig()          # the policy's adapters (dim 0: none)

    def __post_init__(self) -> None:
        def fail(name: str, accepted: str) -> None:
            raise ValueError(f"DPOJobConfig.{name}={getattr(self, name)!r} is invalid; "
                             f"accepted: {accepted}")

        if not isinstance(self.dpo, DPOConfig):
            fail("dpo", "a zeroxla.rlhf.DPOConfig")
        if not isinstance(self.lora, LoRAConfig):
            fail("lora", "a zeroxla.lora.LoRAConfig")
        for name, low in (("steps", 1), ("eval_every", 1), ("save_every", 0), ("seed", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                fail(name, f"an integer >= {low}")
        if self.zero_stage not in (0, 1, 2, 3):
            fail("zero_stage", "0, 1, 2 or 3")
        if not 0 < self.val_fraction < 1:
            fail("val_fraction", "a number in (0, 1)")
        if len(self.mesh) != 2 or not all(isinstance(n, int) and n >= 1 for n in self.mesh):
            fail("mesh", "(nodes, local) with both >= 1, e.g. (2, 4)")
        check_batch(self.dpo.batch_size, "--batch-size", self.mesh)

    def record(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "mesh": list(self.mesh)}

    @classmethod
    def from_record(cls, record: dict[str, Any], **changes: Any) -> "DPOJobConfig":
        values = {**record, "dpo": DPOConfig(**record["dpo"]), "mesh": tuple(record["mesh"]),
                  "lora": LoRAConfig(**record.get("lora", {}))}
        return cls(**{**values, **changes})


def open_policy(init_from: str, seq_len: int,
                lora: LoRAConfig = LoRAConfig()) -> tuple[Any, Callable[[], Any]]:
    """(tokenizer, load) of `--init-from`, a HF causal LM directory (any other head refused by
    name) or a `zeroxla train` run: everything that can be refused without the weights is
    checked here (the head, the tokenizer against the vocabulary, `seq_len` against the
    positions, `lora`'s --lora-module-name against the weights); `load()` reads the weights
    into a plain model (a LoRA run's adapters merged, `load_trained`)."""
    path = Path(init_from)
    if (path / "config.json").is_file():
        try:
            hf = hf_io.read_hf_config(path)
            hf_io.check_head(hf, (hf_io.CAUSAL_LM,), user="`zeroxla dpo`",
                             instead="DPO trains a causal LM's log-probs")
            config = hf_io.from_hf_config(hf)
        except ValueError as err:
            raise ValueError(f"--init-from {init_from}: {err}") from None
        tokenizer = PretrainedTokenizer.from_dir(path)
        tokenizer.check_vocab(config.vocab_size, f"{init_from}/config.json")
        load = lambda: hf_io.load_hf_model(path)[1]                       # noqa: E731
    else:
        directory = rundir.checkpoint_dir_of(path) if path.is_dir() else None
        if directory is None or checkpoint.latest_step(directory) is None:
            raise ValueError(f"--init-from {init_from} is neither; accepted: {INIT_ACCEPTED}")
        meta = checkpoint.read_metadata(directory)
        if meta["metadata"].get("model_kind") is not None or "tokenizer" not in meta["metadata"]:
            raise ValueError(f"--init-from {init_from}: its checkpoint is not a language "
                             f"model's with a recorded tokenizer; accepted: {INIT_ACCEPTED}")
        config = checkpoint.model_config_from_record(meta["model_config"])
        tokenizer = tokenizer_from_record(meta["metadata"]["tokenizer"])
        load = lambda: load_trained(directory)                            # noqa: E731
    limit = getattr(config, "max_seq_len", None)
    if limit is not None and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} exceeds the max_seq_len={limit} of --init-from "
                         f"{init_from}; accepted: --seq-len <= {limit}")
    check_adapters(config, lora)
    return tokenizer, load


def pair_rows(job: DPOJobConfig, tokenizer: Any) -> tuple[dict, dict, int]:
    """(train, val) `dpo.pair_batch` rows of `--data` (or the bundled pairs) and how many pairs
    have the same chosen and rejected tokens: kept and counted as `zeroxla reward` does
    (`learnable.same_pairs`), refused when they are all of the file or of a split.

    Each row's sum runs over the tokens after the longest prefix the chosen and rejected rows
    share: the prompt, and any first answer tokens both answers begin with. A shared token has
    the same log-prob in both rows (same context, causal model) under the policy and under the
    reference, so it cancels in every DPO quantity (loss, margin, accuracy); the boundary needs
    no knowledge of where a chat template ends the prompt."""
    examples = (chat_data.read_pair_jsonl(job.data) if job.data is not None
                else chat_data.shakespeare_pairs(BUNDLED_PAIRS, seed=job.seed))
    source = f"--data {job.data}" if job.data else "the bundled shakespeare pairs"
    splits = {name: chat_data.pair_arrays(part, tokenizer, job.dpo.seq_len,
                                          eos_id=getattr(tokenizer, "eos_id", None))
              for name, part in zip(("training", "validation"),
                                    split_examples(examples, job.val_fraction, job.seed))}
    same = same_pairs(source, splits, "one log-ratio for both: the DPO loss is constant with a "
                                      "zero gradient")
    parts = []
    for arrays in splits.values():
        shared = np.argmax(arrays["chosen"] != arrays["rejected"], axis=1)      # [N]
        parts.append(pair_batch(arrays, {"chosen": shared, "rejected": shared}))
    return parts[0], parts[1], same


@contextlib.contextmanager
def _claimed(out: Path, *, fresh: bool, resuming: Path | None) -> Iterator[Callable[[], bool]]:
    """The run directory, claimed (`rundir.claim`); if the block raises before anything under
    checkpoint/ exists, what the block wrote is removed (a fresh run only)."""
    held = rundir.claim(out, fresh=fresh, resuming=resuming)
    saved = lambda: (out / rundir.CHECKPOINT_DIR).is_dir()    # noqa: E731
    try:
        yield saved
    except BaseException:
        if resuming is None and not saved():
            if held.created is not None:
                shutil.rmtree(held.created, ignore_errors=True)
            else:
                for name in rundir.run_files(out):
                    target = out / name
                    shutil.rmtree(target) if target.is_dir() else target.unlink()
        raise
    finally:
        held.release()


def resume_job(path: str | Path, **changes: Any) -> tuple[DPOJobConfig, rundir.ResumePoint]:
    """The job a `zeroxla dpo` run recorded in its checkpoint (`--resume PATH`: the run, its
    checkpoint/ or one step), with `changes` (e.g. steps) applied, and where to continue."""
    point = rundir.locate_resume(path)
    meta = checkpoint.read_metadata(point.checkpoint_dir, point.step)["metadata"]
    if meta.get("job_kind") != KIND:
        raise ValueError(f"--resume {path} is not a `zeroxla dpo` run: its checkpoint records "
                         f"job_kind={meta.get('job_kind')!r}, not {KIND!r}")
    out_dir = str(point.run_dir) if point.run_dir is not None else None
    return DPOJobConfig.from_record(meta["dpo_job"], **{"out_dir": out_dir, **changes}), point


def _say(record: dict[str, Any]) -> str:
    text = (f"step {record['step']:>5}: loss {record.get('loss', float('nan')):.4f}  accuracy "
            f"{record.get('accuracy', float('nan')):.3f}  margin "
            f"{record.get('margin', float('nan')):.4f}")
    if "val_accuracy" in record:
        text += (f"  | held-out loss {record['val_loss']:.4f}  accuracy "
                 f"{record['val_accuracy']:.3f}  margin {record['val_margin']:.4f}")
    return text


def _train(job: DPOJobConfig, trainer: DPOTrainer, out: Path, first: int, records: list[dict],
           save: Callable[[], Path], write: Callable[[str], None]) -> int | None:
    """Steps `first` .. `job.steps` - 1, each record appended to metrics.jsonl as it is made;
    returns the stop signal's number when one ended the loop early (after its save)."""
    from tqdm import tqdm

    rundir.write_metrics(out / rundir.METRICS_FILE, records)
    with stop_requests(*STOP_SIGNALS) as stop, \
            open(out / rundir.METRICS_FILE, "a", encoding="utf-8") as f, \
            tqdm(total=job.steps, initial=first, desc="dpo", unit="step",
                 disable=not job.progress) as bar:
        for k in range(first, job.steps):
            record = trainer.step_record(k)
            if (k + 1) % job.eval_every == 0 or k + 1 == job.steps:
                record.update(trainer.evaluate())
                write(_say(record))
            records.append(record)
            f.write(json.dumps(record) + "\n")
            f.flush()
            bar.set_postfix_str(f"loss {record['loss']:.3f} acc {record['accuracy']:.2f}",
                                refresh=False)
            bar.update()
            if stop.requested or (job.save_every and (k + 1) % job.save_every == 0):
                save()
            if stop.requested:
                return stop.signum
    return None


def run(job: DPOJobConfig, *, resume: rundir.ResumePoint | None = None,
        write: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs DPO as `job` says (continuing `resume`, from `resume_job`); returns the summary
    (also in summary.json). A stop signal saves the step that ran and returns a summary with
    `stopped_by` (the signal's number)."""
    start = time.perf_counter()
    mesh = job_mesh(job.mesh)                # a --mesh larger than the devices is refused here
    tokenizer, load = open_policy(job.init_from, job.dpo.seq_len, job.lora)
    train, val, same = pair_rows(job, tokenizer)
    resuming = resume.run_dir if resume is not None else None
    out = Path(job.out_dir) if job.out_dir else rundir.default_run_dir(
        "dpo", now=datetime.datetime.now())
    rundir.check_out_dir(out, resuming=resuming)
    policy = load()
    trainer = DPOTrainer(job.dpo, policy, mesh=mesh, train=train, val=val, seed=job.seed,
                         zero_config=zeroxla.ZeroConfig(stage=job.zero_stage,
                                                        persistence_threshold=0), lora=job.lora)
    if resume is None:
        records = [{"step": 0, **trainer.evaluate()}]
    else:
        restored = checkpoint.restore(resume.checkpoint_dir, trainer.step, step=resume.step)
        trainer.state = restored.state
        records = [r for r in rundir.read_metrics(out / rundir.METRICS_FILE)
                   if r["step"] <= restored.checkpoint_step]
    first = int(jax.device_get(trainer.state.step))
    write(f"zeroxla dpo: {job.init_from} on {job.data or 'the bundled shakespeare pairs'} "
          f"({len(train['chosen'])} train / {len(val['chosen'])} held-out pairs"
          f"{same_pairs_note(same)}), "
          f"{job.dpo.loss_type} loss, beta {job.dpo.beta}, ZeRO-{job.zero_stage} on a "
          f"{job.mesh[0]}x{job.mesh[1]} mesh, steps {first + 1}..{job.steps}"
          + (f", LoRA rank {job.lora.dim}" if job.lora.enabled else ""))
    meta = {"job_kind": KIND, "dpo_job": job.record(), "tokenizer": tokenizer_record(tokenizer),
            LORA_KEY: as_metadata(job.lora), BASE_KEY: adapters_base(job.init_from)}

    def save() -> Path:
        path = out / rundir.CHECKPOINT_DIR / str(int(jax.device_get(trainer.state.step)))
        if path.is_dir():                     # this step is saved already
            return path
        return checkpoint.save(out / rundir.CHECKPOINT_DIR, trainer.state,
                               layout=trainer.step.layout, metadata=meta)

    with _claimed(out, fresh=job.out_dir is None and resume is None, resuming=resuming):
        stopped = _train(job, trainer, out, first, records, save, write)
        path = save()
        summary = {"steps": len(records) - 1, "first_val_accuracy": records[0]["val_accuracy"],
                   **{k: v for k, v in records[-1].items() if k != "step"},
                   "checkpoint": str(path), "wall_time_s": time.perf_counter() - start,
                   "reference_bytes": trainer.reference_bytes,
                   "pairs_without_preference": same,
                   "parameters": parameter_counts(trainer.step.layout), "settings": job.record()}
        if stopped is None:
            summary["policy_hf"] = export_policy(out, tokenizer, policy)
        else:
            summary["stopped_by"] = int(stopped)
        (out / rundir.SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def export_policy(out: Path, tokenizer: Any, policy: Any) -> str:
    """The newest checkpoint as a Hugging Face causal LM in `out/policy_hf` with the tokenizer."""
    export = out / EXPORT_DIR
    export_checkpoint(out / rundir.CHECKPOINT_DIR, export)
    save_tokenizer(tokenizer, export, model_max_length=policy.config.max_seq_len)
    return str(export)


__all__ = ["BUNDLED_PAIRS", "DPOJobConfig", "EXPORT_DIR", "KIND", "export_policy", "open_policy",
           "pair_rows", "resume_job", "run"]

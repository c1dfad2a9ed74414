"""`zeroxla grpo`: the GRPO family (GRPO, Dr.GRPO, DAPO, RLOO's baseline) with verifiable rewards.

    zeroxla grpo --actor runs/sft --iterations 50                    # the bundled task
    zeroxla grpo --actor runs/sft --prompts rows.jsonl --reward-funcs mymod:score --out runs/g

- actor and reference: the `--actor` run's final checkpoint (a `zeroxla train` run, or any
  zeroxla checkpoint recording its tokenizer); the reference stays frozen;
- prompts: each line's `prompt`; every other key goes to the reward functions (e.g. `answer`).
  Without `--prompts`: the bundled arithmetic task (`zeroxla.rlhf.arithmetic_task`), whose
  held-out problems are also scored greedily before and after (`accuracy_before/after`);
- rewards: `--reward-funcs` (built in `accuracy`, `format`, or `module:function`), weighted by
  `--reward-weights`, plus a `--reward` model's end score (its weight the last one);
- every `--save-every` iterations (and at the end) the actor's ZeRO checkpoint; the first
  Ctrl-C (or SIGTERM) finishes the iteration, saves, and exits 130 (143); `--resume RUN`
  continues from the run's newest checkpoint with the same options;
- LoRA (`--lora-dim`, ...: `zeroxla train`'s options): adapters on the actor, not the
  reference; the Hybrid Engine generates with base + adapters; the checkpoint records them,
  actor_hf/ is the merged actor, and summary.json's "parameters" counts what trains. A LoRA
  `--actor` run is read merged (`load_trained`) and gets new adapters.

Writes metrics.jsonl (one record per iteration: reward, accuracy, KL, loss, clipped fractions,
the time split), reward_kl.png, summary.json, checkpoint/ and actor_hf/ (the actor as a Hugging
Face checkpoint with its tokenizer).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


from zeroxla import checkpoint
from zeroxla.app import rundir
from zeroxla.app.cli_args import check_batch
from zeroxla.app.data import read_records
from zeroxla.app.distributed import job_mesh
from zeroxla.app.hf_tokenizer import save_tokenizer
from zeroxla.app.interrupt import STOP_SIGNALS, stop_requests
from zeroxla.app.ppo_job import check_inference_tp, load_actor, load_reward
from zeroxla.app.tokenizer_records import tokenizer_record
from zeroxla.app.train.lora import BASE_KEY, adapters_base
from zeroxla.app.train.model import check_adapters
from zeroxla.app.train.report import parameter_counts
from zeroxla.checkpoint.adapters import METADATA_KEY as LORA_KEY
from zeroxla.checkpoint.adapters import as_metadata
from zeroxla.checkpoint.export import export_checkpoint
from zeroxla.lora import LoRAConfig
from zeroxla.rlhf import GRPOConfig, plot_records
from zeroxla.rlhf import arithmetic_task as task
from zeroxla.rlhf.grpo import GRPOTrainer, exact_accuracy, run_grpo
from zeroxla.rlhf.grpo_prompts import longest_prompt, truncation_report
from zeroxla.rlhf.reward_funcs import RewardFunctions, load_reward_func

PLOT_FILE = "reward_kl.png"
ACTOR_EXPORT_DIR = "actor_hf"
TASK_SPLIT = dict(n_train=2000, n_test=200, seed=0)     # the bundled task's problems
TASK_DIGITS = 2
TASK_REWARDS = ("accuracy", "format")


class GRPOInterrupted(Exception):
    """A stop signal ended the run after `iteration` iterations; a checkpoint was saved."""

    def __init__(self, signum: int, iteration: int, run_dir: Path):
        self.signum, self.iteration, self.run_dir = signum, iteration, run_dir
        super().__init__(f"interrupted {self.where}; saved a checkpoint in "
                         f"{run_dir / rundir.CHECKPOINT_DIR}")

    @property
    def where(self) -> str:
        """'after iteration N', N 0-based as metrics.jsonl counts; 'before iteration 0'."""
        return f"after iteration {self.iteration - 1}" if self.iteration else "before iteration 0"


class GRPOFinished(Exception):
    """`--resume` of a run that has run every one of `--iterations`: nothing is left to do."""

    def __init__(self, run_dir: Path, done: int, iterations: int):
        super().__init__(f"nothing left to do: --resume {run_dir} has run its last iteration, "
                         f"{done - 1}, of --iterations {iterations}; accepted: a larger "
                         "--iterations to continue it")
        self.run_dir, self.done = run_dir, done


@dataclasses.dataclass(frozen=True)
class GRPOJobConfig:
    """Everything `zeroxla grpo` needs; `grpo` holds the algorithm's hyper-parameters, whose
    `prompt_length` is replaced by the longest prompt's tokens unless `prompt_length` is set
    (a prompt longer than it keeps its last tokens, counted: `grpo_prompts.truncation_report`)."""

    actor: str
    prompts: str | None = None               # None: the bundled arithmetic task
    reward_funcs: tuple[str, ...] = ()       # default with the task: accuracy, format
    reward_weights: tuple[float, ...] | None = None
    reward: str | None = None                # a `zeroxla reward` run or HF reward model
    grpo: GRPOConfig = GRPOConfig()
    prompt_length: int | None = None
    iterations: int = 10
    save_every: int | None = None
    resume: str | None = None
    mesh: tuple[int, int] = (2, 4)
    inference_tp_size: int = 2
    seed: int = 0
    out_dir: str | None = None
    lora: LoRAConfig = LoRAConfig()          # the actor's adapters (dim 0: none)

    def __post_init__(self) -> None:
        for name, cls in (("grpo", GRPOConfig), ("lora", LoRAConfig)):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"GRPOJobConfig.{name} must be a {cls.__name__}, got "
                                f"{type(getattr(self, name)).__name__}")
        for name in ("iterations", "inference_tp_size", "save_every", "prompt_length"):
            value = getattr(self, name)
            if value is None and name in ("save_every", "prompt_length"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GRPOJobConfig.{name}={value!r} is invalid; accepted: an "
                                 "integer >= 1")
        if self.prompts is not None and not self.reward_funcs and self.reward is None:
            raise ValueError("--prompts without --reward-funcs or --reward: no reward; accepted: "
                             "at least one of them")
        sources = len(self.reward_funcs or (TASK_REWARDS if self.prompts is None else ()))
        sources += self.reward is not None
        if self.reward_weights is not None and len(self.reward_weights) != sources:
            raise ValueError(f"--reward-weights has {len(self.reward_weights)} values for "
                             f"{sources} reward sources (--reward-funcs, then --reward); "
                             "accepted: one weight per source")
        # Each rollout (prompts x generations rows) is one global batch of the actor's step.
        check_batch(self.grpo.rows_per_iteration, "--per-iteration-prompts x --num-generations",
                    self.mesh)


def _prompt_rows(job: GRPOJobConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(prompt rows, held-out task problems; [] for --prompts)."""
    if job.prompts is None:
        train, test = task.split_problems(**TASK_SPLIT, digits=TASK_DIGITS)
        return train, test
    rows = []
    for line, record in read_records(job.prompts):
        if not isinstance(record.get("prompt"), str):
            raise ValueError(f"{job.prompts}:{line}: no \"prompt\" string; accepted: objects "
                             "with a \"prompt\" (other keys go to the reward functions)")
        rows.append(record)
    return rows, []


def _prompt_length(job: GRPOJobConfig, rows: list[dict[str, Any]], tokenizer: Any) -> int:
    """--max-prompt-seq-len, else the longest prompt's tokens (of `rows`: the prompts and the
    held-out problems; shorter prompts are right-padded, exactly: `rlhf.grpo_prompts`); the
    bundled task first checks that the actor's tokenizer writes every character of it."""
    if job.prompts is None:
        unknown = [ch for ch in task.ALPHABET if not _encodes(tokenizer, ch)]
        if unknown:
            raise ValueError(f"--actor {job.actor}: its tokenizer cannot write the bundled task "
                             f"(characters {''.join(unknown)!r}); accepted: an actor SFT'd on "
                             "the task (zeroxla.rlhf.task_sft), or give --prompts")
    # at least 1: prompts of no token are then refused by row (`grpo_prompts.prompt_rows`)
    return job.prompt_length or max(longest_prompt(rows, tokenizer), 1)


def _encodes(tokenizer: Any, text: str) -> bool:
    try:
        tokenizer.encode(text)
    except ValueError:
        return False
    return True


def _reward_funcs(job: GRPOJobConfig) -> tuple[RewardFunctions | None, float]:
    names = job.reward_funcs or (TASK_REWARDS if job.prompts is None else ())
    weights = job.reward_weights
    model_weight = weights[-1] if weights and job.reward is not None else 1.0
    if not names:
        return None, model_weight
    funcs = tuple(load_reward_func(name) for name in names)
    return RewardFunctions(funcs, tuple(weights[:len(funcs)]) if weights else None), model_weight


def _save(out: Path, trainer: GRPOTrainer, tokenizer: Any, iteration: int,
          job: GRPOJobConfig) -> Path:
    """The actor's ZeRO checkpoint, numbered by its optimizer step, with the next iteration."""
    return checkpoint.save(out / rundir.CHECKPOINT_DIR, trainer.actor_state,
                           layout=trainer.actor_step.layout,
                           metadata={"tokenizer": tokenizer_record(tokenizer),
                                     "iteration": iteration, "actor": str(job.actor),
                                     "grpo": dataclasses.asdict(trainer.config),
                                     LORA_KEY: as_metadata(job.lora),
                                     BASE_KEY: adapters_base(job.actor)})


def _restore(job: GRPOJobConfig, trainer: GRPOTrainer) -> tuple[int, Path]:
    """Loads `--resume`'s newest checkpoint into `trainer`; (next iteration, run directory)."""
    point = rundir.locate_resume(job.resume)
    meta = checkpoint.read_metadata(point.checkpoint_dir, point.step)["metadata"]
    if meta.get(LORA_KEY) != as_metadata(job.lora):
        raise ValueError(f"--resume {job.resume} was run with LoRA {meta.get(LORA_KEY)}, not "
                         f"{as_metadata(job.lora)}; accepted: the same --lora-dim, --lora-alpha, "
                         "--lora-module-name and --only-optimize-lora as that run")
    restored = checkpoint.restore(point.checkpoint_dir, trainer.actor_step, step=point.step)
    meta = restored.metadata
    if meta.get("grpo") != dataclasses.asdict(trainer.config) or meta.get("actor") != str(
            job.actor):
        raise ValueError(f"--resume {job.resume} was run with other GRPO options or --actor "
                         f"({meta.get('actor')}); accepted: the same options as that run")
    trainer.actor_state = restored.state
    return int(meta["iteration"]), point.run_dir or Path(job.resume)


def _check_left(job: GRPOJobConfig) -> None:
    """`GRPOFinished` when `--resume` names a finished run (its summary.json written) whose
    newest checkpoint has run `--iterations` (its "iteration" is the next one to run)."""
    if job.resume is None:
        return
    point = rundir.locate_resume(job.resume)
    done = checkpoint.read_metadata(point.checkpoint_dir, point.step)["metadata"].get("iteration")
    run_dir = point.run_dir or Path(job.resume)
    if isinstance(done, int) and done >= job.iterations and (
            run_dir / rundir.SUMMARY_FILE).is_file():
        raise GRPOFinished(run_dir, done, job.iterations)


def _out_dir(job: GRPOJobConfig) -> Path:
    if job.out_dir:
        return Path(job.out_dir)
    return rundir.default_run_dir("grpo", now=datetime.datetime.now())


def _metrics_writer(path: Path, start: int, write: Callable[[str], None]):
    kept = [r for r in _read_records(path) if r.get("iteration", start) < start]
    rundir.write_metrics(path, kept)
    f = open(path, "a", encoding="utf-8")

    def on_iteration(record: dict[str, Any]) -> None:
        f.write(json.dumps(record) + "\n")
        f.flush()
        accuracy = f"  accuracy {record['accuracy']:.3f}" if "accuracy" in record else ""
        write(f"iteration {record['iteration']:>3}: reward {record['reward']:.4f}{accuracy}  KL "
              f"{record['kl']:.5f}  loss {record['loss']:.4f}  clipped "
              f"{record['clip_fraction']:.3f}")
    return f, kept, on_iteration


def _read_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue                       # a torn last line
    return out


def _check_fit(job: GRPOJobConfig, config: GRPOConfig, actor: Any) -> None:
    """Prompt + answer tokens fit the actor's positions, and --inference-tp-size its heads."""
    need = config.prompt_length + config.max_completion_length
    limit = getattr(getattr(actor, "config", None), "max_seq_len", None)
    given = ("--max-prompt-seq-len" if job.prompt_length else
             "the longest prompt's; --max-prompt-seq-len cuts longer ones")
    if limit is not None and need > limit:
        raise ValueError(f"prompt tokens {config.prompt_length} ({given}) + "
                         f"--max-completion-length {config.max_completion_length} = {need} "
                         f"exceed the max_seq_len={limit} of --actor {job.actor}; accepted: a "
                         f"sum <= {limit}")
    check_inference_tp(job.inference_tp_size, job.mesh, getattr(actor, "config", None),
                       f"--actor {job.actor}")


def _evaluate(model: Any, held_out: list, tokenizer: Any, job: GRPOJobConfig,
              config: GRPOConfig, mesh: Any, eos_id: int | None) -> float | None:
    """Greedy exact-answer accuracy of `model` on the bundled task's held-out problems."""
    if not held_out:
        return None
    return exact_accuracy(model, held_out, tokenizer, config, mesh=mesh, eos_id=eos_id,
                          inference_tp_size=job.inference_tp_size)


def _newline(tokenizer: Any) -> int | None:
    ids = tokenizer.encode(task.END) if _encodes(tokenizer, task.END) else []
    return int(ids[0]) if len(ids) == 1 else None


def _train(job: GRPOJobConfig, out: Path, trainer: GRPOTrainer, tokenizer: Any, start: int,
           write: Callable[[str], None]) -> tuple[list[dict[str, Any]], int | None]:
    """Iterations `start` .. `job.iterations - 1`, saving every `--save-every` and at the end
    or a stop request; returns all records (earlier ones too) and the stop signal, if any."""
    f, records, log = _metrics_writer(out / rundir.METRICS_FILE, start, write)
    saved = []                                   # iterations saved at
    with f, stop_requests(*STOP_SIGNALS) as stop:
        def on_iteration(record: dict[str, Any]) -> None:
            log(record)
            done = record["iteration"] + 1
            if job.save_every and done % job.save_every == 0:
                _save(out, trainer, tokenizer, done, job)
                saved.append(done)

        result = run_grpo(trainer.config, job.iterations, None, mesh=None, tokenizer=tokenizer,
                          prompts=(), trainer=trainer, start_iteration=start,
                          should_stop=lambda: stop.requested, on_iteration=on_iteration)
        records += result.records
        done = start + len(result.records)
        if done not in saved and (done > start or not job.resume):   # else: the one restored
            _save(out, trainer, tokenizer, done, job)
        return records, (stop.signum if done < job.iterations else None)


def _finish(job: GRPOJobConfig, out: Path, trainer: GRPOTrainer, tokenizer: Any,
            records: list[dict[str, Any]], mesh: Any, held_out: list,
            before: float | None) -> dict[str, Any]:
    """The plot, the actor exported to Hugging Face with its tokenizer, and the summary."""
    plot_records(records).savefig(out / PLOT_FILE, dpi=100)
    export = out / ACTOR_EXPORT_DIR
    export_checkpoint(out / rundir.CHECKPOINT_DIR, export)
    save_tokenizer(tokenizer, export, model_max_length=trainer.actor_step.layout.model_def
                   .abstract_module().config.max_seq_len)
    config = trainer.config
    return {"iterations": job.iterations, "first_reward": records[0]["reward"],
            "last_reward": records[-1]["reward"], "last_kl": records[-1]["kl"],
            "accuracy_before": before,
            "accuracy_after": _evaluate(trainer.actor_model(), held_out, tokenizer, job,
                                        config, mesh, trainer.eos_id),
            "paths": {"checkpoint": str(out / rundir.CHECKPOINT_DIR), "actor_hf": str(export)},
            "parameters": parameter_counts(trainer.actor_step.layout),
            "lora": dataclasses.asdict(job.lora), "grpo": dataclasses.asdict(config)}


def run(job: GRPOJobConfig, *, write: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the GRPO job as `job` says; returns the summary (also in summary.json). A fresh run
    that fails removes what it wrote; a stop signal saves and raises `GRPOInterrupted`;
    `--resume` of a finished run raises `GRPOFinished` before it writes anything."""
    start_time = time.perf_counter()
    _check_left(job)
    reward_funcs, model_weight = _reward_funcs(job)         # a user's module fails here, first
    mesh = job_mesh(job.mesh)
    actor, tokenizer = load_actor(job.actor)
    rows, held_out = _prompt_rows(job)
    config = job.grpo.replace(prompt_length=_prompt_length(job, rows + held_out, tokenizer))
    _check_fit(job, config, actor)
    check_adapters(actor.config, job.lora)
    reward_model = None if job.reward is None else load_reward(job.reward, actor, tokenizer)
    eos_id = getattr(tokenizer, "eos_id", None)
    eos_id = _newline(tokenizer) if eos_id is None and job.prompts is None else eos_id
    resuming = None if job.resume is None else rundir.locate_resume(job.resume).run_dir
    out = Path(resuming) if resuming and not job.out_dir else _out_dir(job)
    held = rundir.claim(out, fresh=job.out_dir is None and resuming is None, resuming=resuming)
    try:
        with rundir.removed_on_failure(out, created=held.created):
            trainer = GRPOTrainer(config, actor, mesh=mesh, tokenizer=tokenizer, prompts=rows,
                                  reward_funcs=reward_funcs or (), reward_model=reward_model,
                                  reward_model_weight=model_weight,
                                  inference_tp_size=job.inference_tp_size, eos_id=eos_id,
                                  seed=job.seed, lora=job.lora)
            start = _restore(job, trainer)[0] if job.resume else 0
            truncation, cut_line = truncation_report(trainer.prompts, held_out, tokenizer)
            if cut_line:
                write(cut_line)
            write(f"zeroxla grpo: actor {job.actor}, {len(rows)} prompts of up to "
                  f"{config.prompt_length} tokens "
                  f"({'the bundled arithmetic task' if job.prompts is None else job.prompts}), "
                  f"iterations {start}..{job.iterations - 1} of {config.prompts_per_iteration} "
                  f"prompts x {config.num_generations} answers, loss {config.loss_type}")
            before = (_evaluate(actor, held_out, tokenizer, job, config, mesh, eos_id)
                      if start == 0 else None)
            records, signum = _train(job, out, trainer, tokenizer, start, write)
            if signum is None:
                summary = _finish(job, out, trainer, tokenizer, records, mesh, held_out, before)
                summary["prompt_truncation"] = truncation
                summary["wall_time_s"] = time.perf_counter() - start_time
                (out / rundir.SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        if signum is not None:          # outside the block: the saved checkpoint stays
            raise GRPOInterrupted(signum, len(records), out)
        return summary
    finally:
        held.release()


__all__ = ["GRPOFinished", "GRPOInterrupted", "GRPOJobConfig", "run"]

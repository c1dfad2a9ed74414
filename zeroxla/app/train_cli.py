"""`zeroxla train` on the command line: its options, and the handler that turns them into a
`TrainJobConfig` (with `--resume`, the saved job's settings unless given again) and runs it.

As every subcommand (see `zeroxla.app.cli`): `add_train(subparsers)` declares the options and sets
`handler`; the handler sets the simulated device count (and starts `jax.distributed` in a
multi-process run) before importing anything that uses JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from zeroxla.app.cli_args import (mesh_shape, non_negative_int, positive_float, positive_int,
                                  set_host_device_count, temperature)
from zeroxla.app.job import DEFAULT_BATCH_SIZE, DEFAULT_LR, DTYPES, TrainJobConfig  # no JAX use
from zeroxla.app.launch import INTERRUPTED

# TrainJobConfig's defaults, for the help texts (the options themselves default to None: "not
# given", so that --resume can tell what the command line sets).
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainJobConfig)}


def add_train(subparsers: argparse._SubParsersAction) -> None:
    """Declares `zeroxla train` and sets its handler to `_run_train`. The options come in
    themes, in `--help` order: model and data, schedule, parallelism, the run."""
    p = subparsers.add_parser(
        "train", help="train a language model with ZeRO on a text file",
        description="Train a models/ preset, character- or byte-level, on a UTF-8 text file "
                    "(default: the bundled tiny-shakespeare) with zeroxla.make_step on a "
                    "(node, local) mesh. Writes metrics.jsonl, loss_curve.png, summary.json and "
                    "checkpoint/ to a run directory: a fresh runs/<model>-<YYYYmmdd-HHMMSS> "
                    "unless --out names one. Ctrl-C saves a checkpoint and exits; --resume "
                    "continues a run with its own settings. Under `zeroxla launch` (or "
                    "ZEROXLA_DISTRIBUTED=auto) it runs as one process of a multi-process job.")
    _add_model_options(p)
    _add_schedule_options(p)
    _add_parallel_options(p)
    _add_run_options(p)
    p.set_defaults(handler=_run_train)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """--model, --init-from, --data, --tokenizer: what is trained, on what."""
    p.add_argument("--model", default=None,
                   help="models/ preset (gpt-tiny, gpt-small, llama-tiny, ...); default "
                        f"{_DEFAULTS['model']}")
    p.add_argument("--init-from", default=None, metavar="HF_DIR",
                   help="start from a pretrained Hugging Face checkpoint (GPT-2 or Llama: "
                        "config.json, safetensors, tokenizer.json), loaded straight into its "
                        "ZeRO partitions; its model and tokenizer replace --model/--tokenizer")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="UTF-8 text file (.gz ok), or a .jsonl of {\"prompt\", \"response\"} "
                        "lines (DeepSpeed-Chat's \"chosen\" also read): supervised fine-tuning, "
                        "the loss on the response tokens only; default: the bundled "
                        "tiny-shakespeare")
    p.add_argument("--tokenizer", choices=("char", "byte"), default=None,
                   help="character-level (vocabulary from the corpus) or UTF-8 byte-level; "
                        "default char (with --init-from: the checkpoint's own)")


def _add_schedule_options(p: argparse.ArgumentParser) -> None:
    """--steps, --batch-size, --seq-len, --lr, --warmup-steps: how long and how big."""
    p.add_argument("--steps", type=positive_int, default=None,
                   help=f"training steps; default {_DEFAULTS['steps']}")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="global batch (DeepSpeed's train_batch_size); default: from --config, "
                        f"else {DEFAULT_BATCH_SIZE}")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per sequence (at most the model's max_seq_len); default "
                        f"{_DEFAULTS['seq_len']}")
    p.add_argument("--lr", type=positive_float, default=None,
                   help="peak learning rate of the default warmup + cosine AdamW recipe (not "
                        "with a --config that has an optimizer or scheduler); default "
                        f"{DEFAULT_LR:g}")
    p.add_argument("--warmup-steps", type=non_negative_int, default=None,
                   help=f"linear warmup steps; default {_DEFAULTS['warmup_steps']}")


def _add_parallel_options(p: argparse.ArgumentParser) -> None:
    """--mesh, --pipeline-stages, the ZeRO options and --config: how the step is laid out
    on the devices, and its DeepSpeed recipe."""
    p.add_argument("--mesh", type=mesh_shape, default=None, metavar="NODESxLOCAL",
                   help="device mesh; on CPU the devices are simulated; default "
                        f"{_DEFAULTS['mesh'][0]}x{_DEFAULTS['mesh'][1]}")
    p.add_argument("--pipeline-stages", type=positive_int, default=None, metavar="S",
                   help="pipeline the model's layers over S stages (1F1B, --grad-accum "
                        "micro-batches), each stage a --mesh of data-parallel devices: S x "
                        "nodes x local devices in all; default 1 (no pipeline)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage (default 3, or zero_optimization.stage from --config)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="compute dtype; master weights and optimizer state stay float32; fp16 "
                        "adds DeepSpeed's dynamic loss scaling (default fp32, or the fp16/bf16 "
                        "section of --config)")
    p.add_argument("--grad-accum", type=positive_int, default=None, metavar="N",
                   help="micro-batches per step (DeepSpeed's gradient_accumulation_steps); the "
                        "batch is split N ways (default 1, or from --config)")
    p.add_argument("--persistence-threshold", type=non_negative_int, default=None, metavar="N",
                   help="parameters with fewer elements stay replicated (DeepSpeed's "
                        "stage3_param_persistence_threshold); default: from --config, else 0 "
                        "(partition every leaf of the tiny default model)")
    p.add_argument("--config", default=None, metavar="DS_CONFIG.json",
                   help="a DeepSpeed JSON config (batch sizes, optimizer, scheduler, fp16/bf16, "
                        "zero_optimization); as in DeepSpeed, no zero_optimization means stage 0")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """--out, --seed, evaluation, checkpoints, the end-of-run sample, --no-progress and
    --resume."""
    p.add_argument("--out", default=None, metavar="DIR",
                   help="run directory; default: a fresh runs/<model>-<YYYYmmdd-HHMMSS> (the "
                        "resumed run's own directory with --resume). A directory that holds "
                        "another run is refused")
    p.add_argument("--seed", type=non_negative_int, default=None,
                   help=f"model init, data order and sampling; default {_DEFAULTS['seed']}")
    p.add_argument("--eval-every", type=positive_int, default=None,
                   help="validation every N steps (and at the end); default "
                        f"{_DEFAULTS['eval_every']}")
    p.add_argument("--eval-batches", type=positive_int, default=None,
                   help=f"validation batches per evaluation; default {_DEFAULTS['eval_batches']}")
    p.add_argument("--save-every", type=non_negative_int, default=None, metavar="N",
                   help="save a checkpoint every N steps (DeepSpeed's checkpoint interval); the "
                        "final step is always saved; default 0: only the final one")
    p.add_argument("--keep-last", type=non_negative_int, default=None, metavar="K",
                   help="keep only the newest K step checkpoints, deleting older ones after a "
                        "newer one is committed (torchtitan's keep_latest_k); default 0: keep all")
    p.add_argument("--sample-tokens", type=non_negative_int, default=None,
                   help="tokens generated from the trained model at the end (Hybrid Engine, "
                        "KV cache; 0: none). Prompt + sample stop at --seq-len, the positions "
                        "the model was trained on: a larger value is capped there and the run "
                        f"says so; default {_DEFAULTS['sample_tokens']}")
    p.add_argument("--temperature", type=temperature, default=None,
                   help="sampling temperature (0: greedy); default "
                        f"{_DEFAULTS['temperature']}")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue a run: its directory, its checkpoint/ or one step in it (the "
                        "newest complete checkpoint by default). The run's own settings (model, "
                        "data, mesh, ZeRO stage, dtype, batch, ...) are restored unless given "
                        "here; metrics.jsonl is appended")


# argparse dest -> TrainJobConfig field: the options that --resume restores unless given.
_JOB_OPTIONS = {"model": "model", "init_from": "init_from", "data": "data",
                "tokenizer": "tokenizer", "steps": "steps", "batch_size": "batch_size",
                "seq_len": "seq_len", "lr": "lr",
                "warmup_steps": "warmup_steps", "mesh": "mesh", "zero_stage": "zero_stage",
                "dtype": "dtype", "grad_accum": "grad_accum",
                "persistence_threshold": "persistence_threshold", "config": "deepspeed_config",
                "seed": "seed", "eval_every": "eval_every", "eval_batches": "eval_batches",
                "save_every": "save_every", "keep_last": "keep_last",
                "sample_tokens": "sample_tokens", "temperature": "temperature",
                "pipeline_stages": "pipeline_stages"}


def _saved_job(resume: Any) -> dict:
    """The metadata `zeroxla train` stored in the checkpoint `--resume` names ({} if none).
    Reads JSON only: JAX is imported but no backend starts."""
    from zeroxla import checkpoint

    return checkpoint.read_metadata(resume.checkpoint_dir, resume.step)["metadata"]


def _set_device_count(mesh: tuple[int, int], env: Any, stages: int = 1) -> None:
    """Simulated CPU devices for this process: the mesh's, or its share of a multi-process mesh
    (unless XLA_FLAGS already has a count, as `zeroxla launch --devices-per-proc` sets it)."""
    from zeroxla.app.distributed import NUM_PROCESSES_ENV

    count = mesh[0] * mesh[1] * stages
    if env is not None and env.auto:
        return                  # a cluster: the devices are real, or the job script sets them
    if env is not None:
        if count % env.num_processes:
            raise ValueError(f"--mesh {mesh[0]}x{mesh[1]} has {count} devices, which the "
                             f"{env.num_processes} processes ({NUM_PROCESSES_ENV}) cannot share "
                             f"evenly; accepted: a mesh of a multiple of {env.num_processes} "
                             f"devices, e.g. {env.num_processes}x{mesh[1]}")
        count //= env.num_processes
    set_host_device_count(count)


def _run_train(args: argparse.Namespace) -> int:
    """Runs `zeroxla train`. Everything up to `distributed.initialize` only reads files: a bad
    option, a --out that holds another run or a --resume without checkpoints is refused before
    JAX starts a backend."""
    from zeroxla.app import distributed, rundir
    from zeroxla.app.job import describe_resume, resumed_fields

    explicit = {field: getattr(args, dest) for dest, field in _JOB_OPTIONS.items()
                if getattr(args, dest) is not None}
    if args.init_from is not None and args.model is not None:
        raise ValueError(f"--model {args.model} with --init-from {args.init_from}: the "
                         "checkpoint's config.json decides the model; give one of them")
    env = distributed.from_environ(os.environ)
    resume = rundir.locate_resume(args.resume) if args.resume else None
    if args.out is not None:
        rundir.check_out_dir(args.out, resuming=resume.run_dir if resume else None)
    saved = _saved_job(resume) if resume else {}
    job = TrainJobConfig(**resumed_fields(saved.get("job"), explicit), out_dir=args.out,
                         progress=not args.no_progress, resume=args.resume)
    _set_device_count(job.mesh, env, job.pipeline_stages)
    if env is not None:
        distributed.initialize(env)
    import jax

    from zeroxla.app import train      # imports JAX: only after the flag is set

    primary = jax.process_index() == 0
    if resume and primary:
        print("\n".join(describe_resume(saved.get("settings"), explicit)), flush=True)
    try:
        summary = train.run(job)
    except train.TrainingInterrupted as stop:
        if primary:
            print(f"zeroxla train: interrupted (Ctrl-C) after step {stop.step}; saved checkpoint "
                  f"{stop.checkpoint_path}\nresume with: zeroxla train --resume {stop.run_dir}",
                  file=sys.stderr, flush=True)
        return INTERRUPTED
    if primary:
        print(train.format_summary(summary), flush=True)
    return 0


__all__ = ["add_train"]

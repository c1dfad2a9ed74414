"""The `zeroxla` command (also `python -m zeroxla`).

    zeroxla train [options]     train a model on a text file (default: gpt-tiny on the bundled
                                tiny-shakespeare, ZeRO-3 on a simulated 2 x 4 CPU mesh)
    zeroxla reward --init-from HF_DIR --data pairs.jsonl
                                a reward model on preference pairs (DeepSpeed-Chat step 2)
    zeroxla ppo --actor SFT_RUN --reward RM_RUN --prompts prompts.jsonl
                                RLHF with PPO (DeepSpeed-Chat step 3; step 1 is
                                `zeroxla train --init-from HF_DIR --data sft.jsonl`)
    zeroxla export CKPT OUT     a checkpoint as Hugging Face safetensors + tokenizer files
    zeroxla generate CKPT --prompt TEXT
                                continue a prompt with the Hybrid Engine (KV cache, --tp)
    zeroxla launch --nproc N -- COMMAND
                                N local processes of COMMAND as one distributed JAX job

Each subcommand is a pair: `_add_<name>(subparsers)` declares its options and sets `handler`, the
function that runs it. To add one (e.g. `export`), write the pair and register it in
`SUBCOMMANDS`.

This module must not start JAX: on a CPU host the number of simulated devices is fixed when the
backend starts, so `train` first sets `XLA_FLAGS=--xla_force_host_platform_device_count=N` (N =
the mesh size; only if the user has not set a count) and only then imports the modules that use
JAX. XLA reads the flag when the first backend is created, not at `import jax`. In a
multi-process run (`zeroxla.app.distributed`) the count is this process's share of the mesh, and
`jax.distributed.initialize` runs before anything else touches JAX. `launch` never starts JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from zeroxla.app.job import DEFAULT_BATCH_SIZE, DEFAULT_LR, DTYPES, TrainJobConfig  # no JAX use
from zeroxla.app.chat_cli import add_ppo, add_reward
from zeroxla.app.cli_args import (host_device_count, mesh_shape, non_negative_int,  # noqa: F401
                                  positive_float, positive_int, set_host_device_count,
                                  temperature)
from zeroxla.app.launch import DEFAULT_GRACE_S, DEVICE_COUNT_FLAG, INTERRUPTED

EXPORT_DTYPES = ("float32", "bfloat16")     # zeroxla.checkpoint.export.DTYPES
# TrainJobConfig's defaults, for the help texts (the options themselves default to None: "not
# given", so that --resume can tell what the command line sets).
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainJobConfig)}


# ------------------------------------------------------------------------------------------------
# train


def _add_train(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="train a language model with ZeRO on a text file",
        description="Train a models/ preset, character- or byte-level, on a UTF-8 text file "
                    "(default: the bundled tiny-shakespeare) with zeroxla.make_step on a "
                    "(node, local) mesh. Writes metrics.jsonl, loss_curve.png, summary.json and "
                    "checkpoint/ to a run directory: a fresh runs/<model>-<YYYYmmdd-HHMMSS> "
                    "unless --out names one. Ctrl-C saves a checkpoint and exits; --resume "
                    "continues a run with its own settings. Under `zeroxla launch` (or "
                    "ZEROXLA_DISTRIBUTED=auto) it runs as one process of a multi-process job.")
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
    p.set_defaults(handler=_run_train)


# argparse dest -> TrainJobConfig field: the options that --resume restores unless given.
_JOB_OPTIONS = {"model": "model", "init_from": "init_from", "data": "data", "tokenizer": "tokenizer", "steps": "steps",
                "batch_size": "batch_size", "seq_len": "seq_len", "lr": "lr",
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


# ------------------------------------------------------------------------------------------------
# export

def _add_export(subparsers: argparse._SubParsersAction) -> None:
    """Declares `zeroxla export` and sets its handler to `run_export`."""
    p = subparsers.add_parser(
        "export", help="write a checkpoint's weights as Hugging Face safetensors",
        description="Consolidate a zeroxla checkpoint into Hugging Face safetensors (GPT-2 or "
                    "Llama names, config.json), one tensor at a time: host memory stays at "
                    "about one shard, whatever the model size (DeepSpeed's zero_to_fp32 "
                    "without its RAM problem).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="checkpoint directory given to zeroxla.save, or one step inside it")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32",
                   help="dtype of the written tensors")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE", type=_size,
                   help="largest safetensors file, e.g. 5GB, 500MB, 2GiB (as in DeepSpeed/HF)")
    p.add_argument("--step", type=int, default=None,
                   help="checkpoint step (default: the newest complete one)")
    p.set_defaults(handler=_run_export)


def _size(text: str) -> int | str:
    """'1000' -> 1000 bytes; '5GB', '500MiB' stay strings for `models.hf.parse_size`."""
    return int(text) if text.strip().isdigit() else text


def _run_export(args: argparse.Namespace) -> int:
    """Runs `zeroxla export`: the weights, then the tokenizer the checkpoint records (a
    `zeroxla train` checkpoint records its character or byte vocabulary); prints the files."""
    from zeroxla.app.hf_tokenizer import save_tokenizer
    from zeroxla.app.tokenizer_records import tokenizer_from_record
    from zeroxla.checkpoint.export import checkpoint_metadata, export_checkpoint

    meta = checkpoint_metadata(args.checkpoint, step=args.step)     # pins the step exported
    files = export_checkpoint(args.checkpoint, args.out, step=meta["step"], dtype=args.dtype,
                              max_shard_size=args.max_shard_size)
    record = meta["metadata"].get("tokenizer")
    tokenizer = None
    if record is not None:
        tokenizer = tokenizer_from_record(record)
        files += save_tokenizer(tokenizer, args.out, model_max_length=meta["model_config"][
            "fields"]["max_seq_len"])
    total = sum(f.stat().st_size for f in files)
    print(json.dumps({"out": str(args.out), "step": meta["step"],
                      "files": [f.name for f in files], "bytes": total,
                      "tokenizer": (f"{record['kind']} ({tokenizer.vocab_size} ids)" if record
                                    else "none recorded in the checkpoint")},
                     indent=2), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# generate

def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    """Declares `zeroxla generate` and sets its handler to `_run_generate`."""
    p = subparsers.add_parser(
        "generate", help="continue a prompt with a trained checkpoint (Hybrid Engine)",
        description="Restore a `zeroxla train` checkpoint and continue --prompt with the Hybrid "
                    "Engine: tensor-parallel over --tp simulated devices, KV-cached decoding.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="checkpoint directory given to zeroxla.save (a train run's checkpoints)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=non_negative_int, default=64)
    p.add_argument("--temperature", type=temperature, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=positive_int, default=None)
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel devices (inference_tp_size): a divisor of the model's "
                        "attention heads (and of the device count when XLA_FLAGS sets one; "
                        "otherwise --tp devices are simulated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None,
                   help="checkpoint step (default: the newest complete one)")
    p.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    """Runs `zeroxla generate`: prints the prompt and its continuation."""
    devices = host_device_count()             # the user's count; None: we simulate --tp devices
    set_host_device_count(args.tp)            # before JAX starts (module docstring)
    from zeroxla.app.sampling import generate_from_checkpoint

    print(generate_from_checkpoint(args.checkpoint, args.prompt,
                                   max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, top_k=args.top_k, tp=args.tp,
                                   seed=args.seed, step=args.step, devices=devices), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# launch

def _add_launch(subparsers: argparse._SubParsersAction) -> None:
    """Declares `zeroxla launch` and sets its handler to `_run_launch`."""
    p = subparsers.add_parser(
        "launch", help="run N local processes of a command as one distributed JAX job",
        description="Start N processes of COMMAND on this machine, joined by JAX's distributed "
                    "runtime: each gets ZEROXLA_COORDINATOR (127.0.0.1:<free port>), "
                    "ZEROXLA_NUM_PROCESSES and ZEROXLA_PROCESS_ID, which `zeroxla train` reads "
                    "to call jax.distributed.initialize (gloo collectives on CPU). Output lines "
                    "are prefixed with [rank i]. If a process fails, the others are stopped "
                    "(SIGTERM, then SIGKILL) and launch exits non-zero naming the rank. Example: "
                    "zeroxla launch --nproc 2 --devices-per-proc 4 -- zeroxla train --mesh 2x4")
    p.add_argument("--nproc", type=positive_int, required=True, metavar="N",
                   help="number of processes")
    p.add_argument("--devices-per-proc", type=positive_int, default=None, metavar="M",
                   help="simulated CPU devices per process (XLA_FLAGS="
                        f"{DEVICE_COUNT_FLAG}=M); default: XLA_FLAGS as it is (GPUs, or the "
                        "command sets the count; zeroxla train uses its share of --mesh)")
    p.add_argument("--grace-period", type=positive_float, default=DEFAULT_GRACE_S,
                   metavar="SECONDS", help="after SIGTERM, how long the other processes get "
                   f"before SIGKILL (default {DEFAULT_GRACE_S:g})")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the command every process runs")
    p.set_defaults(handler=_run_launch)


def _run_launch(args: argparse.Namespace) -> int:
    """Runs `zeroxla launch`; returns the job's exit status."""
    from zeroxla.app.launch import launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("no COMMAND given; accepted: zeroxla launch --nproc N "
                         "[--devices-per-proc M] -- COMMAND [ARGS ...]")
    return launch(command, args.nproc, devices_per_proc=args.devices_per_proc,
                  grace_s=args.grace_period)


# ------------------------------------------------------------------------------------------------

SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_train, add_reward, add_ppo, _add_export, _add_generate, _add_launch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroxla", description="DeepSpeed's ZeRO machinery, rebuilt natively on JAX/XLA.")
    parser.add_argument("--traceback", action="store_true",
                        help="show the full traceback of configuration errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zeroxla` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        if args.traceback:
            raise
        print(f"zeroxla {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        # RuntimeError: zeroxla.checkpoint.CheckpointError (corrupt or incomplete checkpoints).
        # Configuration mistakes name the option and the accepted values; a traceback would
        # bury that line (--traceback shows it, e.g. for a ValueError that is a bug).
        if args.traceback:
            raise
        print(f"zeroxla {args.command}: error: {err}\n(run `zeroxla --traceback "
              f"{args.command} ...` for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

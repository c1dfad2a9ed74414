"""The `zeroxla` command (also `python -m zeroxla`).

    zeroxla train [options]     train a model on a text file (default: gpt-tiny on the bundled
                                tiny-shakespeare, ZeRO-3 on a simulated 2 x 4 CPU mesh)

Each subcommand is a pair: `_add_<name>(subparsers)` declares its options and sets `handler`, the
function that runs it. To add one (e.g. `export`), write the pair and register it in
`SUBCOMMANDS`.

This module must not start JAX: on a CPU host the number of simulated devices is fixed when the
backend starts, so `train` first sets `XLA_FLAGS=--xla_force_host_platform_device_count=N` (N =
the mesh size; only if the user has not set a count) and only then imports the modules that use
JAX. XLA reads the flag when the first backend is created, not at `import jax`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
EXPORT_DTYPES = ("float32", "bfloat16")     # zeroxla.checkpoint.export.DTYPES


def _mesh_shape(text: str) -> tuple[int, int]:
    """'2x4' -> (2, 4)."""
    try:
        nodes, local = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh {text!r} is invalid; accepted: NODESxLOCAL with "
                                         "positive integers, e.g. 2x4") from None
    if nodes < 1 or local < 1:
        raise argparse.ArgumentTypeError(f"--mesh {text!r} is invalid; accepted: NODESxLOCAL with "
                                         "positive integers, e.g. 2x4")
    return nodes, local


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: an integer >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: a positive number")
    return value


def set_host_device_count(count: int, environ: dict | None = None) -> bool:
    """Adds `--xla_force_host_platform_device_count=count` to XLA_FLAGS unless a count is set.

    Returns whether it set the flag. Must run before JAX creates its CPU backend. The flag only
    affects the host (CPU) platform, so it is harmless on GPU/TPU machines.
    """
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG in flags:
        return False
    environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={count}".strip()
    return True


# ------------------------------------------------------------------------------------------------
# train


def _add_train(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="train a language model with ZeRO on a text file",
        description="Train a models/ preset, character- or byte-level, on a UTF-8 text file "
                    "(default: the bundled tiny-shakespeare) with zeroxla.make_step on a "
                    "(node, local) mesh. Writes metrics.jsonl, loss_curve.png and summary.json "
                    "to --out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="gpt-tiny",
                   help="models/ preset (gpt-tiny, gpt-small, llama-tiny, ...)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="UTF-8 text file (.gz ok); default: the bundled tiny-shakespeare")
    p.add_argument("--tokenizer", choices=("char", "byte"), default="char",
                   help="character-level (vocabulary from the corpus) or UTF-8 byte-level")
    p.add_argument("--steps", type=_positive_int, default=None, help="training steps "
                   "(default: the tuned default of TrainJobConfig)")
    p.add_argument("--batch-size", type=_positive_int, default=None,
                   help="global batch (DeepSpeed's train_batch_size); default: from --config, "
                        "else the tuned default")
    p.add_argument("--seq-len", type=_positive_int, default=None,
                   help="tokens per sequence (at most the model's max_seq_len)")
    p.add_argument("--lr", type=_positive_float, default=None,
                   help="peak learning rate of the default warmup + cosine AdamW recipe (not "
                        "with a --config that has an optimizer or scheduler)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warmup steps")
    p.add_argument("--mesh", type=_mesh_shape, default=(2, 4), metavar="NODESxLOCAL",
                   help="device mesh; on CPU the devices are simulated")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage (default 3, or zero_optimization.stage from --config)")
    p.add_argument("--persistence-threshold", type=int, default=None, metavar="N",
                   help="parameters with fewer elements stay replicated (DeepSpeed's "
                        "stage3_param_persistence_threshold); default: from --config, else 0 "
                        "(partition every leaf of the tiny default model)")
    p.add_argument("--config", default=None, metavar="DS_CONFIG.json",
                   help="a DeepSpeed JSON config (batch sizes, optimizer, scheduler, fp16/bf16, "
                        "zero_optimization); as in DeepSpeed, no zero_optimization means stage 0")
    p.add_argument("--out", default="runs/train", metavar="DIR", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="model init, data order and sampling")
    p.add_argument("--eval-every", type=_positive_int, default=None,
                   help="validation every N steps (and at the end)")
    p.add_argument("--eval-batches", type=_positive_int, default=None,
                   help="validation batches per evaluation")
    p.add_argument("--sample-tokens", type=int, default=None,
                   help="tokens sampled from the trained model at the end")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from the newest complete checkpoint in DIR (e.g. "
                        "runs/train/checkpoint), on this run's mesh and stage")
    p.set_defaults(handler=_run_train)


# argparse dest -> TrainJobConfig field, for options whose default is the dataclass's.
_TRAIN_FIELDS = {"steps": "steps", "seq_len": "seq_len", "warmup_steps": "warmup_steps",
                 "eval_every": "eval_every", "eval_batches": "eval_batches",
                 "sample_tokens": "sample_tokens", "temperature": "temperature"}


def _run_train(args: argparse.Namespace) -> int:
    nodes, local = args.mesh
    set_host_device_count(nodes * local)
    from zeroxla.app import train      # imports JAX: only after the flag is set

    overrides = {field: getattr(args, dest) for dest, field in _TRAIN_FIELDS.items()
                 if getattr(args, dest) is not None}
    job = train.TrainJobConfig(
        model=args.model, data=args.data, tokenizer=args.tokenizer, batch_size=args.batch_size,
        lr=args.lr, mesh=(nodes, local), zero_stage=args.zero_stage,
        persistence_threshold=args.persistence_threshold,
        deepspeed_config=args.config, out_dir=args.out, seed=args.seed,
        progress=not args.no_progress, resume=args.resume, **overrides)
    summary = train.run(job)
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
    """Runs `zeroxla export`; prints the files written."""
    from zeroxla.checkpoint.export import export_checkpoint

    files = export_checkpoint(args.checkpoint, args.out, step=args.step, dtype=args.dtype,
                              max_shard_size=args.max_shard_size)
    total = sum(f.stat().st_size for f in files)
    print(json.dumps({"out": str(args.out), "files": [f.name for f in files],
                      "bytes": total}, indent=2), flush=True)
    return 0



# ------------------------------------------------------------------------------------------------

SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_train,
                                                                         _add_export)


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

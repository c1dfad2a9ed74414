"""The `zeroxla` command (also `python -m zeroxla`).

    zeroxla train [options]     train a model on a text file (default: gpt-tiny on the bundled
                                tiny-shakespeare, ZeRO-3 on a simulated 2 x 4 CPU mesh)
    zeroxla reward --init-from HF_DIR --data pairs.jsonl
                                a reward model on preference pairs (DeepSpeed-Chat step 2)
    zeroxla ppo --actor SFT_RUN --reward RM_RUN --prompts prompts.jsonl
                                RLHF with PPO (DeepSpeed-Chat step 3; step 1 is
                                `zeroxla train --init-from HF_DIR --data sft.jsonl`)
    zeroxla dpo --init-from HF_DIR_OR_RUN [--data pairs.jsonl] --steps N
                                Direct Preference Optimization (or IPO) on preference pairs
    zeroxla grpo --actor SFT_RUN [--prompts ROWS_JSONL --reward-funcs module:fn ...]
                                GRPO / Dr.GRPO / DAPO with verifiable rewards (default: the
                                bundled arithmetic task)
    zeroxla export CKPT OUT     a checkpoint as Hugging Face safetensors + tokenizer files
    zeroxla generate CKPT --prompt TEXT
                                continue a prompt with the Hybrid Engine (KV cache, --tp)
    zeroxla plan --model HF_DIR_OR_PRESET [--seq-len T | --max-seq-len]
                                what fits a device, by compile only (`zeroxla.app.jobs.plan`)
    zeroxla launch --nproc N -- COMMAND
                                N local processes of COMMAND as one distributed JAX job

A job (`train`, `reward`, `ppo`, `dpo`, `grpo`) is its `JobSpec` (`zeroxla.app.jobs.*`; train's
in `zeroxla.app.jobs.train.cli`): `add_job` declares its options from its rows and sets the one
handler every job has (`zeroxla.app.run.command`). The other subcommands are pairs:
`_add_<name>(subparsers)` declares its options and sets `handler`, the function that runs it.
Either is registered in `SUBCOMMANDS`.

This module must not start JAX: on a CPU host the number of simulated devices is fixed when the
backend starts, so a job first sets `XLA_FLAGS=--xla_force_host_platform_device_count=N` (N =
the mesh size; only if the user has not set a count) and only then imports the modules that use
JAX. XLA reads the flag when the first backend is created, not at `import jax`. In a
multi-process run (`zeroxla.app.distributed`) the count is this process's share of the mesh, and
`jax.distributed.initialize` runs before anything else touches JAX. `launch` never starts JAX.
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
from collections.abc import Callable, Sequence

from zeroxla.app.cli_args import (host_device_count, mesh_shape, non_negative_int,  # noqa: F401
                                  positive_float, positive_int, set_host_device_count,
                                  temperature)
from zeroxla.app.interrupt import exit_status, signal_name, terminate_raises
from zeroxla.app.jobs import dpo, grpo, ppo, reward
from zeroxla.app.jobs.plan import add_plan
from zeroxla.app.jobs.train import cli as train
from zeroxla.app.launch import DEFAULT_GRACE_S, DEVICE_COUNT_FLAG
from zeroxla.app.run.command import add_job
from zeroxla.inference.sampling import TEMPERATURE_RULE

EXPORT_DTYPES = ("float32", "bfloat16")     # zeroxla.checkpoint.export.DTYPES


# ------------------------------------------------------------------------------------------------
# export

def _add_export(subparsers: argparse._SubParsersAction) -> None:
    """Declares `zeroxla export` and sets its handler to `run_export`."""
    p = subparsers.add_parser(
        "export", help="write a checkpoint's weights as Hugging Face safetensors",
        description="Consolidate a zeroxla checkpoint into Hugging Face safetensors (its "
                    "family's transformers names and config.json: GPT-2, Llama 3.x, Qwen2, "
                    "Qwen3, Mistral, Gemma 2), one tensor at a time: host memory stays at "
                    "about one shard, whatever the model size (DeepSpeed's zero_to_fp32 "
                    "without its RAM problem). A language model becomes its family's "
                    "*ForCausalLM (GPT2LMHeadModel for GPT-2); a reward model (zeroxla reward, "
                    "a PPO critic) its *ForSequenceClassification with num_labels=1 and a pad "
                    "token transformers scores by.",
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
    p.add_argument("--adapter-only", action="store_true",
                   help="a LoRA run's adapters alone, as a PEFT adapter (adapter_config.json, "
                        "adapter_model.safetensors) for the base they trained on (train's and "
                        "dpo's --init-from, grpo's --actor checkpoint step), of a run with "
                        "--only-optimize-lora (else its base trained too: refused); without it "
                        "a LoRA run is written merged, W + (alpha / r) A @ B")
    p.set_defaults(handler=_run_export)


def _size(text: str) -> int | str:
    """'1000' -> 1000 bytes; '5GB', '500MiB' stay strings for `models.hf.parse_size`."""
    return int(text) if text.strip().isdigit() else text


def _run_export(args: argparse.Namespace) -> int:
    """Runs `zeroxla export` (`export_run`); prints its report."""
    if args.adapter_only:
        report = export_adapter(args.checkpoint, args.out, step=args.step)
    else:
        report = export_run(args.checkpoint, args.out, step=args.step, dtype=args.dtype,
                            max_shard_size=args.max_shard_size)
    print(json.dumps(report, indent=2), flush=True)
    return 0


def export_adapter(checkpoint: str, out: str, *, step: int | None = None) -> dict:
    """`zeroxla export --adapter-only`: checkpoint `step`'s LoRA adapters as a PEFT adapter
    (`zeroxla.checkpoint.export.save_adapter`) whose base_model_name_or_path is the weights the
    run's adapters apply to (`recorded_base`: train's and dpo's --init-from, a zeroxla run's
    checkpoint step for grpo's --actor; None for a preset's run). Returns a report: out, step,
    files, base."""
    from zeroxla.app.jobs.loading import recorded_base
    from zeroxla.checkpoint.export import checkpoint_metadata, save_adapter

    meta = checkpoint_metadata(checkpoint, step=step)
    base = recorded_base(meta)
    files = save_adapter(checkpoint, out, step=meta["step"], base_model_name_or_path=base)
    return {"out": str(out), "step": meta["step"], "files": sorted(f.name for f in files),
            "bytes": sum(f.stat().st_size for f in files), "base_model_name_or_path": base}


def export_run(checkpoint: str, out: str, *, step: int | None = None, dtype: str = "float32",
               max_shard_size: int | str = "5GB") -> dict:
    """`zeroxla export`: checkpoint `step` (default: the newest) as a HF directory `out`, the
    weights (`zeroxla.checkpoint.export`: a causal LM, or a reward model as a one-label
    `*ForSequenceClassification`), then the tokenizer the checkpoint records (a `zeroxla train`
    checkpoint records its character or byte vocabulary), with a reward model's pad token
    (`hf_tokenizer.reward_pad_id`). Returns a report: out, step, model class, files, bytes,
    tokenizer, and a reward model's pad_token_id."""
    from pathlib import Path

    from zeroxla.app.tokenizers.pretrained import (PAD_TOKEN, add_pad_token, reward_pad_id,
                                                   save_tokenizer)
    from zeroxla.app.tokenizers.records import tokenizer_from_record
    from zeroxla.checkpoint.export import checkpoint_head, checkpoint_metadata, export_checkpoint
    from zeroxla.models.hf import SEQUENCE_CLASSIFICATION

    meta = checkpoint_metadata(checkpoint, step=step)                  # pins the step exported
    fields = meta["model_config"]["fields"] if meta["model_config"] else {}
    record = meta["metadata"].get("tokenizer")
    tokenizer = None if record is None else tokenizer_from_record(record)
    pad, new_token = None, False
    if checkpoint_head(checkpoint, step=meta["step"]) == SEQUENCE_CLASSIFICATION:
        pad, new_token = reward_pad_id(tokenizer, fields["vocab_size"])
    token_ids = {f"{name}_token_id": getattr(tokenizer, f"{name}_id", None)
                 for name in ("bos", "eos")}
    files = export_checkpoint(checkpoint, out, step=meta["step"], dtype=dtype,
                              max_shard_size=max_shard_size, pad_token_id=pad,
                              token_ids={k: v for k, v in token_ids.items() if v is not None})
    if tokenizer is not None:
        files += save_tokenizer(tokenizer, out, model_max_length=fields["max_seq_len"])
        if new_token:
            files += add_pad_token(out, pad)
    config = json.loads((Path(out) / "config.json").read_text())
    return {"out": str(out), "step": meta["step"], "model": config["architectures"][0],
            "files": sorted({f.name for f in files}),
            "bytes": sum(f.stat().st_size for f in set(files)),
            "tokenizer": (f"{record['kind']} ({tokenizer.vocab_size} ids"
                          f"{f', + {PAD_TOKEN} = {pad}' if new_token else ''})" if record
                          else "none recorded in the checkpoint"),
            **({"pad_token_id": pad} if pad is not None else {})}


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
    p.add_argument("--temperature", type=temperature, default=0.8,
                   help=f"sampling temperature: {TEMPERATURE_RULE}")
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
    from zeroxla.app.jobs.generate import generate_from_checkpoint

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
    *(functools.partial(add_job, spec=spec)
      for spec in (train.SPEC, reward.SPEC, ppo.SPEC, dpo.SPEC, grpo.SPEC)),
    _add_export, _add_generate, add_plan, _add_launch)


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
        with terminate_raises():        # SIGTERM: cleanups run, as for Ctrl-C; exit 143
            return args.handler(args)
    except KeyboardInterrupt as stop:
        if args.traceback:
            raise
        signum = getattr(stop, "signum", signal.SIGINT)
        print(f"zeroxla {args.command}: interrupted ({signal_name(signum)})", file=sys.stderr)
        return exit_status(signum)
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

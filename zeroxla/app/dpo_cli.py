"""`zeroxla dpo` on the command line (the job: `zeroxla.app.dpo_job`).

As every subcommand (see `zeroxla.app.cli`): `add_dpo(subparsers)` declares the options and sets
`handler`; the handler sets the simulated device count before importing anything that uses JAX.
"""

from __future__ import annotations

import argparse
import json

from zeroxla.app.chat_cli import LORA_OPTIONS, add_lora_options, lora_config
from zeroxla.app.cli_args import (mesh_shape, non_negative_int, positive_float, positive_int,
                                  set_host_device_count)

LOSS_TYPES = ("sigmoid", "ipo")        # zeroxla.rlhf.dpo.LOSS_TYPES (no JAX import here)


def add_dpo(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dpo", help="Direct Preference Optimization of a causal LM on preference pairs",
        description="DPO (Rafailov et al. 2023; IPO with --loss-type ipo) of a Hugging Face "
                    "causal LM or a zeroxla train run on {\"prompt\", \"chosen\", \"rejected\"} "
                    "pairs under ZeRO, against a frozen reference (the starting model), whose "
                    "log-probs are computed once. Writes metrics.jsonl (loss, accuracy, margin "
                    "per step; held-out val_* every --eval-every steps), summary.json, "
                    "checkpoint/ and policy_hf/ (the policy as a Hugging Face checkpoint, LoRA "
                    "adapters merged). Ctrl-C saves the running step; --resume RUN continues it.")
    p.add_argument("--init-from", metavar="HF_DIR_OR_RUN", default=None,
                   help="a Hugging Face causal LM directory (with tokenizer) or a zeroxla train "
                        "run directory; required unless --resume")
    p.add_argument("--data", default=None, metavar="PAIRS_JSONL",
                   help="preference pairs: a .jsonl of {\"prompt\", \"chosen\", \"rejected\"} "
                        "lines (strings, or TRL's lists of messages, rendered with the "
                        "checkpoint's chat template) or a .json array of them (.gz ok); "
                        "default: the bundled tiny-shakespeare pairs (true next line vs. its "
                        "letters scrambled). Pairs whose chosen and rejected are the same tokens "
                        "teach nothing: they are counted and reported, and a file (or its train "
                        "or validation split) of only such pairs is refused")
    p.add_argument("--steps", type=positive_int, default=None, help="default 100")
    p.add_argument("--resume", default=None, metavar="RUN",
                   help="continue this zeroxla dpo run (its directory, checkpoint/ or one step) "
                        "with the settings it recorded; --steps may extend it")
    p.add_argument("--out", default=None, metavar="DIR")
    dpo = p.add_argument_group("DPO hyper-parameters (TRL's DPOConfig names)")
    dpo.add_argument("--beta", type=positive_float, default=0.1,
                     help="the KL strength: rewards are beta x (policy - reference) log-ratios")
    dpo.add_argument("--loss-type", choices=LOSS_TYPES, default="sigmoid")
    dpo.add_argument("--learning-rate", type=positive_float, default=1e-4)
    dpo.add_argument("--batch-size", type=positive_int, default=16, help="pairs per step")
    dpo.add_argument("--seq-len", type=positive_int, default=64,
                     help="prompt + answer tokens (a longer pair is an error, not truncated)")
    dpo.add_argument("--reference-int8", action="store_true",
                     help="hold the frozen reference as int8 codes (ZeRO++ MixZ++)")
    p.add_argument("--mesh", type=mesh_shape, default=(2, 4), metavar="NODESxLOCAL",
                   help="the (node, local) device mesh; its devices must divide --batch-size")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=3)
    p.add_argument("--eval-every", type=positive_int, default=20)
    p.add_argument("--save-every", type=non_negative_int, default=0,
                   help="checkpoint every N steps (0: at the end and at Ctrl-C only)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--no-progress", action="store_true")
    add_lora_options(p, "the policy's (not the frozen reference's)")
    p.set_defaults(handler=run_dpo, dpo_parser=p)


RESUME_KEEPS = ("resume", "steps", "no_progress", "handler", "dpo_parser", "command", "traceback")


def _check_resume_options(args: argparse.Namespace) -> None:
    """A resumed run keeps the settings it recorded: any other option given is refused by name
    (it would otherwise be silently ignored)."""
    flags = {"lora_" + field: option for field, option in LORA_OPTIONS.items()}
    given = sorted(flags.get(dest, f"--{dest.replace('_', '-')}")
                   for dest, value in vars(args).items()
                   if dest not in RESUME_KEEPS and value != args.dpo_parser.get_default(dest))
    if given:
        raise ValueError(f"--resume continues a run with the settings it recorded; "
                         f"{', '.join(given)} cannot change them; accepted with --resume: "
                         "--steps, --no-progress")


def run_dpo(args: argparse.Namespace) -> int:
    """Runs `zeroxla dpo`; prints the summary. Exits with the signal's status after a stop."""
    if args.resume is None and args.init_from is None:
        raise ValueError("--init-from is required (a Hugging Face causal LM directory or a "
                         "zeroxla train run), unless --resume RUN continues a run")
    # Importing the job starts no JAX backend; reading a checkpoint's metadata is plain JSON,
    # so a resumed run's recorded --mesh sets the device count before the backend starts.
    from zeroxla.app import dpo_job
    from zeroxla.app.interrupt import exit_status
    from zeroxla.rlhf.dpo import DPOConfig

    if args.resume is not None:
        _check_resume_options(args)
        changes = {} if args.steps is None else {"steps": args.steps}
        job, point = dpo_job.resume_job(args.resume, progress=not args.no_progress, **changes)
    else:
        job, point = dpo_job.DPOJobConfig(
            init_from=args.init_from, data=args.data, steps=args.steps or 100,
            dpo=DPOConfig(beta=args.beta, loss_type=args.loss_type,
                          learning_rate=args.learning_rate, batch_size=args.batch_size,
                          seq_len=args.seq_len, reference_int8=args.reference_int8),
            mesh=args.mesh, zero_stage=args.zero_stage, eval_every=args.eval_every,
            save_every=args.save_every, seed=args.seed, out_dir=args.out,
            progress=not args.no_progress, lora=lora_config(args)), None
    set_host_device_count(job.mesh[0] * job.mesh[1])
    summary = dpo_job.run(job, resume=point)
    print(json.dumps({k: v for k, v in summary.items() if k != "settings"}, indent=2),
          flush=True)
    return exit_status(summary["stopped_by"]) if "stopped_by" in summary else 0


__all__ = ["add_dpo", "run_dpo"]

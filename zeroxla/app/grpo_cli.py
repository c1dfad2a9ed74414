"""`zeroxla grpo` on the command line: `add_grpo(subparsers)` declares the options (TRL's
`GRPOConfig` names, dashed) and sets the handler, which sets the simulated device count before
importing anything that uses JAX (see `zeroxla.app.cli`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from zeroxla.app.chat_cli import add_lora_options, lora_config
from zeroxla.app.cli_args import (mesh_shape, non_negative_float, non_negative_int,
                                  positive_float, positive_int, set_host_device_count)

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")        # zeroxla.rlhf.grpo_config (no JAX import here)
SCALE_REWARDS = ("group", "batch", "none")
ADVANTAGES = ("grpo", "rloo")
ROLLOUT_CORRECTIONS = ("tis",)


def add_grpo(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "grpo", help="GRPO / Dr.GRPO / DAPO / RLOO with verifiable rewards (no critic)",
        description="The GRPO family from an SFT run: num-generations answers per prompt from "
                    "the Hybrid Engine, rewards from reward functions (and/or a reward model), "
                    "group-relative advantages, the clipped surrogate under ZeRO-3. Without "
                    "--prompts it runs the bundled arithmetic task (rewards: accuracy, format; "
                    "held-out accuracy before and after in summary.json). Writes metrics.jsonl, "
                    "reward_kl.png, summary.json, checkpoint/ and actor_hf/. The first Ctrl-C "
                    "saves a checkpoint and exits; --resume RUN continues it.")
    p.add_argument("--actor", required=True, metavar="SFT_RUN",
                   help="a zeroxla run directory (or checkpoint) whose checkpoint records its "
                        "tokenizer: the policy's start and the frozen reference")
    p.add_argument("--prompts", default=None, metavar="ROWS_JSONL",
                   help="a .jsonl of {\"prompt\", ...} lines; the other keys are passed to the "
                        "reward functions. Default: the bundled arithmetic task")
    p.add_argument("--reward-funcs", nargs="+", default=(), metavar="FUNC",
                   help="accuracy | format | module:function, each (prompts, completions, "
                        "**row_fields) -> list[float]; default with the bundled task: accuracy "
                        "format")
    p.add_argument("--reward-weights", nargs="+", type=float, default=None, metavar="W",
                   help="one weight per --reward-funcs entry, then one for --reward (default 1)")
    p.add_argument("--reward", default=None, metavar="RM_RUN",
                   help="a zeroxla reward run or HF reward model: its end score is a reward")
    p.add_argument("--iterations", type=positive_int, default=10)
    p.add_argument("--save-every", type=positive_int, default=None, metavar="N",
                   help="save a checkpoint every N iterations (and always at the end)")
    p.add_argument("--resume", default=None, metavar="RUN",
                   help="continue a grpo run from its newest checkpoint (same options)")
    p.add_argument("--out", default=None, metavar="DIR")
    p.add_argument("--mesh", type=mesh_shape, default=(2, 4), metavar="NODESxLOCAL",
                   help="the (node, local) device mesh; its devices must divide "
                        "--per-iteration-prompts x --num-generations; default 2x4")
    p.add_argument("--inference-tp-size", type=positive_int, default=2,
                   help="tensor-parallel devices of the Hybrid Engine's rollouts")
    p.add_argument("--seed", type=non_negative_int, default=0)
    g = p.add_argument_group("GRPO hyper-parameters (TRL's GRPOConfig names and defaults)")
    g.add_argument("--num-generations", type=positive_int, default=None)
    g.add_argument("--loss-type", choices=LOSS_TYPES, default=None)
    g.add_argument("--scale-rewards", choices=SCALE_REWARDS, default=None)
    g.add_argument("--advantage", choices=ADVANTAGES, default=None,
                   help="the baseline: the group mean (grpo) or leave-one-out (rloo)")
    g.add_argument("--epsilon", type=positive_float, default=None)
    g.add_argument("--epsilon-high", type=positive_float, default=None,
                   help="upper clip (DAPO's clip-higher); default: --epsilon")
    g.add_argument("--beta", type=non_negative_float, default=None,
                   help="weight of the k3 KL to the frozen reference (default 0)")
    g.add_argument("--num-iterations", type=positive_int, default=None,
                   help="policy updates per rollout batch (mu)")
    g.add_argument("--learning-rate", type=positive_float, default=None)
    g.add_argument("--per-iteration-prompts", dest="prompts_per_iteration", type=positive_int,
                   default=None)
    g.add_argument("--max-completion-length", type=positive_int, default=None)
    g.add_argument("--max-prompt-seq-len", dest="prompt_length_option", type=positive_int,
                   metavar="N",
                   default=None, help="prompt tokens kept (the last ones); default: the "
                   "shortest prompt's")
    g.add_argument("--rollout-correction", choices=ROLLOUT_CORRECTIONS, default=None,
                   help="tis: truncated importance sampling of the train/rollout log-prob gap "
                   "(TRL's vllm_importance_sampling_correction)")
    g.add_argument("--tis-cap", type=positive_float, default=None, metavar="C",
                   help="the largest importance weight of --rollout-correction tis (default 2)")
    g.add_argument("--reference-int8", action="store_const", const=True, default=None,
                   help="hold the frozen reference as int8 codes (ZeRO++ MixZ++)")
    add_lora_options(p, "the actor's (not the frozen reference's)")
    p.set_defaults(handler=run_grpo_command)


def run_grpo_command(args: argparse.Namespace) -> int:
    set_host_device_count(args.mesh[0] * args.mesh[1])
    from zeroxla.app import grpo_job
    from zeroxla.app.interrupt import exit_status, signal_name
    from zeroxla.rlhf import GRPOConfig

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig)
             if getattr(args, f.name, None) is not None}
    job = grpo_job.GRPOJobConfig(
        actor=args.actor, prompts=args.prompts, reward_funcs=tuple(args.reward_funcs),
        reward_weights=None if args.reward_weights is None else tuple(args.reward_weights),
        reward=args.reward, grpo=GRPOConfig(**given), prompt_length=args.prompt_length_option,
        iterations=args.iterations, save_every=args.save_every, resume=args.resume,
        mesh=args.mesh, inference_tp_size=args.inference_tp_size, seed=args.seed,
        out_dir=args.out, lora=lora_config(args))
    try:
        summary = grpo_job.run(job)
    except grpo_job.GRPOInterrupted as stop:
        print(f"zeroxla grpo: interrupted ({signal_name(stop.signum)}) after iteration "
              f"{stop.iteration}; saved a checkpoint\nresume with: zeroxla grpo --resume "
              f"{stop.run_dir} (and the same options)", file=sys.stderr, flush=True)
        return exit_status(stop.signum)
    print(json.dumps({k: v for k, v in summary.items() if k != "grpo"}, indent=2), flush=True)
    return 0


__all__ = ["add_grpo", "run_grpo_command"]

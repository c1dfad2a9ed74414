"""`zeroxla grpo` on the command line: `add_grpo(subparsers)` declares the options (TRL's
`GRPOConfig` names, dashed; `HYPER_PARAMETERS`, one row per GRPOConfig field) and sets the
handler, which sets the simulated device count before anything starts a JAX backend (see
`zeroxla.app.cli`)."""

from __future__ import annotations

import argparse
import json
import sys

from zeroxla.app.chat_cli import add_lora_options, lora_config
from zeroxla.app.cli_args import (finite_float, mesh_shape, non_negative_float, non_negative_int,
                                  positive_float, positive_int, set_host_device_count)
from zeroxla.app.train.options import JobOption
from zeroxla.rlhf.grpo_config import (ADVANTAGES, LOSS_TYPES, ROLLOUT_CORRECTIONS, SCALE_REWARDS,
                                      GRPOConfig, GRPOConfigError)

# The GRPOConfig options, one row each (`zeroxla train`'s `JobOption`: the row knows the field it
# sets, so an error about a field names the option the user typed). Each defaults to None: not
# given, GRPOConfig's default.
HYPER_PARAMETERS: tuple[JobOption, ...] = tuple(
    JobOption(flag, dest, GRPOConfig, dest, "grpo", help, **kwargs)
    for flag, dest, help, kwargs in (
        ("--num-generations", "num_generations", "G, answers per prompt (>= 2)",
         dict(type=positive_int)),
        ("--loss-type", "loss_type", None, dict(choices=LOSS_TYPES)),
        ("--scale-rewards", "scale_rewards", None, dict(choices=SCALE_REWARDS)),
        ("--advantage", "advantage", "the baseline: the group mean (grpo) or leave-one-out "
         "(rloo)", dict(choices=ADVANTAGES)),
        ("--epsilon", "epsilon", "lower clip of the importance ratio, in (0, 1)",
         dict(type=positive_float)),
        ("--epsilon-high", "epsilon_high", "upper clip (DAPO's clip-higher); default: "
         "--epsilon", dict(type=positive_float)),
        ("--beta", "beta", "weight of the k3 KL to the frozen reference (default 0)",
         dict(type=non_negative_float)),
        ("--num-iterations", "num_iterations", "policy updates per rollout batch (mu)",
         dict(type=positive_int)),
        ("--learning-rate", "learning_rate", None, dict(type=positive_float)),
        ("--per-iteration-prompts", "prompts_per_iteration", None, dict(type=positive_int)),
        ("--max-completion-length", "max_completion_length", None, dict(type=positive_int)),
        ("--rollout-correction", "rollout_correction", "tis: truncated importance sampling of "
         "the train/rollout log-prob gap (TRL's vllm_importance_sampling_correction)",
         dict(choices=ROLLOUT_CORRECTIONS)),
        ("--tis-cap", "tis_cap", "the largest importance weight of --rollout-correction tis "
         "(default 2)", dict(type=positive_float, metavar="C")),
        ("--reference-int8", "reference_int8", "hold the frozen reference as int8 codes "
         "(ZeRO++ MixZ++)", dict(action="store_true"))))


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
    p.add_argument("--reward-weights", nargs="+", type=finite_float, default=None, metavar="W",
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
    for option in HYPER_PARAMETERS:
        option.add_to(g)
    g.add_argument("--max-prompt-seq-len", dest="prompt_length_option", type=positive_int,
                   metavar="N",
                   default=None, help="most prompt tokens (a longer prompt keeps its last "
                   "N, counted in the log and summary.json); default: the longest prompt's")
    add_lora_options(p, "the actor's (not the frozen reference's)")
    p.set_defaults(handler=run_grpo_command)


def run_grpo_command(args: argparse.Namespace) -> int:
    set_host_device_count(args.mesh[0] * args.mesh[1])
    from zeroxla.app import grpo_job
    from zeroxla.app.interrupt import exit_status, signal_name

    job = grpo_job.GRPOJobConfig(
        actor=args.actor, prompts=args.prompts, reward_funcs=tuple(args.reward_funcs),
        reward_weights=None if args.reward_weights is None else tuple(args.reward_weights),
        reward=args.reward, grpo=grpo_config(args), prompt_length=args.prompt_length_option,
        iterations=args.iterations, save_every=args.save_every, resume=args.resume,
        mesh=args.mesh, inference_tp_size=args.inference_tp_size, seed=args.seed,
        out_dir=args.out, lora=lora_config(args))
    try:
        summary = grpo_job.run(job)
    except grpo_job.GRPOInterrupted as stop:
        print(f"zeroxla grpo: interrupted ({signal_name(stop.signum)}) {stop.where}; saved a "
              f"checkpoint\nresume with: zeroxla grpo --resume {stop.run_dir} (and the same "
              "options)", file=sys.stderr, flush=True)
        return exit_status(stop.signum)
    except grpo_job.GRPOFinished as finished:
        print(f"zeroxla grpo: {finished}", file=sys.stderr, flush=True)
        return 0
    print(json.dumps({k: v for k, v in summary.items() if k != "grpo"}, indent=2), flush=True)
    return 0


def grpo_config(args: argparse.Namespace) -> GRPOConfig:
    """The GRPOConfig of the given `HYPER_PARAMETERS` (GRPOConfig's defaults for the others); a
    bad value is a ValueError naming the option as typed ("--num-generations 1"), not the field."""
    by_field = {o.field: o for o in HYPER_PARAMETERS}
    given = {o.field: getattr(args, o.dest) for o in HYPER_PARAMETERS
             if getattr(args, o.dest) is not None}
    try:
        return GRPOConfig(**given)
    except GRPOConfigError as err:
        raise ValueError(f"{by_field[err.field].flag} {err.value} is invalid; accepted: "
                         f"{err.accepted}") from None


__all__ = ["HYPER_PARAMETERS", "add_grpo", "grpo_config", "run_grpo_command"]

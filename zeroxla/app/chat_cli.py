"""`zeroxla reward` and `zeroxla ppo`: DeepSpeed-Chat's steps 2 and 3 on the command line (step 1
is `zeroxla train --init-from HF_DIR --data sft.jsonl`).

As every subcommand (see `zeroxla.app.cli`): `add_<name>(subparsers)` declares the options and
sets `handler`; the handler sets the simulated device count before importing anything that
uses JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from zeroxla.app.cli_args import (mesh_shape, non_negative_float, non_negative_int,
                                  positive_float, positive_int, set_host_device_count,
                                  unit_interval)

DS_CHAT = "DeepSpeed-Chat's name and default"
MESH_HELP = ("the (node, local) device mesh; its NODES x LOCAL data-parallel devices must divide "
             "the global batch ({batch}); default 2x4")
NO_RESUME = ("There is no --resume: a run that fails or is interrupted removes what it wrote, so "
             "the same --out can be given again.")


def add_lora_options(parser: argparse.ArgumentParser, whose: str) -> None:
    """`zeroxla train`'s LoRA options (DeepSpeed-Chat's --lora_dim, --lora_module_name,
    --only_optimize_lora, and alpha), for `whose` weights; read back by `lora_config`."""
    g = parser.add_argument_group(f"LoRA: adapters on {whose} weights (zeroxla train's options)")
    g.add_argument("--lora-dim", dest="lora_dim", type=non_negative_int, metavar="R",
                   help="adapter rank; default 0: no LoRA")
    g.add_argument("--lora-alpha", dest="lora_alpha", type=positive_float,
                   help="the adapters are scaled by alpha / r; default 1")
    g.add_argument("--lora-module-name", dest="lora_module_name", metavar="REGEX",
                   help="regular expression over weight paths (blocks/layers/wq): the weights "
                        "that get adapters; default blocks/layers/ (every block weight)")
    g.add_argument("--only-optimize-lora", dest="lora_only_optimize_lora",
                   action="store_const", const=True,
                   help="train the adapters alone (needs --lora-dim > 0)")


LORA_OPTIONS = {"dim": "--lora-dim", "alpha": "--lora-alpha",
                "module_name": "--lora-module-name", "only_optimize_lora": "--only-optimize-lora"}


def lora_config(args: argparse.Namespace):
    """The `zeroxla.lora.LoRAConfig` of `add_lora_options`' options (its defaults for those not
    given); an error names the option."""
    from zeroxla.lora import LoRAConfig

    given = {field: getattr(args, "lora_" + field)
             for field in LORA_OPTIONS}
    try:
        return LoRAConfig(**{k: v for k, v in given.items() if v is not None})
    except ValueError as err:
        field = str(err).split("=", 1)[0].removeprefix("LoRAConfig.")
        raise ValueError(f"{LORA_OPTIONS.get(field, field)}: {err}") from None


def add_reward(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "reward", help="train a reward model on preference pairs (DeepSpeed-Chat step 2)",
        description="A pretrained Hugging Face checkpoint (--init-from) plus a scalar head (a "
                    "causal LM gets a zero one; a *ForSequenceClassification reward model with "
                    "num_labels=1 keeps its own), trained with -log sigmoid(r_chosen - "
                    "r_rejected) on the end scores of {\"prompt\", \"chosen\", \"rejected\"} "
                    "JSONL pairs under ZeRO. Writes metrics.jsonl (loss; validation accuracy and "
                    "margin), summary.json and checkpoint/ (read by zeroxla ppo --reward; "
                    "zeroxla export writes it as a *ForSequenceClassification). " + NO_RESUME)
    p.add_argument("--init-from", required=True, metavar="HF_DIR",
                   help="a Hugging Face checkpoint directory of a family in docs/models.md (with "
                        "tokenizer): "
                        "a causal LM, or a reward model (*ForSequenceClassification, "
                        "num_labels=1)")
    p.add_argument("--data", required=True, metavar="PAIRS_JSONL",
                   help="preference pairs: a .jsonl of {\"prompt\", \"chosen\", \"rejected\"} "
                        "lines (strings, or TRL's lists of {\"role\", \"content\"} messages, "
                        "rendered with the checkpoint's chat template), or a .json array of "
                        "those objects (.gz ok). Pairs whose chosen "
                        "and rejected are the same tokens teach nothing: they are counted and "
                        "reported, and a file (or its train or validation split) of only such "
                        "pairs is refused")
    p.add_argument("--steps", type=positive_int, default=200)
    p.add_argument("--batch-size", type=positive_int, default=16, help="pairs per step")
    p.add_argument("--seq-len", type=positive_int, default=64,
                   help="prompt + answer tokens (a longer pair is an error, not truncated)")
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--weight-decay", type=non_negative_float, default=0.0)
    p.add_argument("--mesh", type=mesh_shape, default=(2, 4), metavar="NODESxLOCAL",
                   help=MESH_HELP.format(batch="--batch-size"))
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=3)
    p.add_argument("--eval-every", type=positive_int, default=50)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--out", default=None, metavar="DIR")
    p.add_argument("--no-progress", action="store_true")
    add_lora_options(p, "the reward model's base")
    p.set_defaults(handler=run_reward)


def run_reward(args: argparse.Namespace) -> int:
    set_host_device_count(args.mesh[0] * args.mesh[1])
    from zeroxla.app import reward_job

    job = reward_job.RewardJobConfig(
        init_from=args.init_from, data=args.data, steps=args.steps, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=args.lr, weight_decay=args.weight_decay, mesh=args.mesh,
        zero_stage=args.zero_stage, eval_every=args.eval_every, seed=args.seed,
        out_dir=args.out, progress=not args.no_progress, lora=lora_config(args))
    summary = reward_job.run(job)
    print(json.dumps({k: v for k, v in summary.items() if k != "settings"}, indent=2),
          flush=True)
    return 0


def add_ppo(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ppo", help="RLHF with PPO from an SFT run and a reward model (DeepSpeed-Chat step 3)",
        description="PPO with the SFT run's model as actor and frozen reference, the critic "
                    "started from the reward model, rollouts by the Hybrid Engine and rewards "
                    "from the learned reward model plus the KL penalty. Writes metrics.jsonl, "
                    "reward_kl.png, summary.json, checkpoint/actor, checkpoint/critic and "
                    "actor_hf/ (the actor as a Hugging Face checkpoint). " + NO_RESUME)
    p.add_argument("--actor", required=True, metavar="SFT_RUN",
                   help="a zeroxla train run directory (step 1)")
    p.add_argument("--reward", required=True, metavar="RM_RUN",
                   help="a zeroxla reward run directory (step 2), or a Hugging Face reward "
                        "model directory (*ForSequenceClassification, num_labels=1, with its "
                        "tokenizer)")
    p.add_argument("--prompts", required=True, metavar="PROMPTS_JSONL",
                   help="a .jsonl of {\"prompt\"} lines, or a .json array of those objects "
                        "(.gz ok; other keys are ignored, so a pairs file serves)")
    p.add_argument("--iterations", type=positive_int, default=10)
    p.add_argument("--out", default=None, metavar="DIR")
    p.add_argument("--mesh", type=mesh_shape, default=(2, 4), metavar="NODESxLOCAL",
                   help=MESH_HELP.format(batch="--per-iteration-prompts"))
    p.add_argument("--inference-tp-size", type=positive_int, default=2,
                   help="tensor-parallel devices of the Hybrid Engine's rollouts: a divisor of "
                        "the mesh's devices and of the actor's attention heads; default 2")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--no-progress", action="store_true")
    ppo = p.add_argument_group("PPO hyper-parameters (" + DS_CHAT + " where it has one)")
    for flag, field, kind in (
            ("--actor-learning-rate", "actor_lr", positive_float),
            ("--critic-learning-rate", "critic_lr", positive_float),
            ("--ppo-epochs", "ppo_epochs", positive_int),
            ("--max-prompt-seq-len", "prompt_length", positive_int),
            ("--max-answer-seq-len", "answer_length", positive_int),
            ("--per-iteration-prompts", "prompts_per_iteration", positive_int),
            ("--kl-ctl", "kl_ctl", non_negative_float),
            ("--clip-reward-value", "clip_reward_value", positive_float),
            ("--cliprange", "cliprange", positive_float),
            ("--cliprange-value", "cliprange_value", positive_float),
            ("--gamma", "gamma", unit_interval), ("--lam", "lam", unit_interval)):
        ppo.add_argument(flag, dest=field, type=kind, default=None)
    add_lora_options(p, "the actor's and the critic's (not the frozen reference's)")
    ppo.add_argument("--reference-int8", dest="reference_int8", action="store_const",
                     const=True, default=None,
                     help="hold the frozen reference as int8 codes (ZeRO++ MixZ++)")
    p.set_defaults(handler=run_ppo)


def run_ppo(args: argparse.Namespace) -> int:
    set_host_device_count(args.mesh[0] * args.mesh[1])
    from zeroxla.app import ppo_job
    from zeroxla.rlhf import PPOConfig

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(PPOConfig)
             if getattr(args, f.name, None) is not None}
    job = ppo_job.PPOJobConfig(actor=args.actor, reward=args.reward, prompts=args.prompts,
                               ppo=PPOConfig(**given), iterations=args.iterations,
                               mesh=args.mesh, inference_tp_size=args.inference_tp_size,
                               seed=args.seed, out_dir=args.out, progress=not args.no_progress,
                               lora=lora_config(args))
    summary = ppo_job.run(job)
    print(json.dumps({k: v for k, v in summary.items() if k != "ppo"}, indent=2), flush=True)
    return 0


__all__ = ["add_lora_options", "add_ppo", "add_reward", "lora_config", "run_ppo", "run_reward"]

"""Per-device temporaries of a GRPO actor step as the rollout grows: the whole packed rollout
in one micro-batch against verl's token budget (`ppo_max_token_len_per_gpu`), from the
compiled programs (nothing runs).

    python benchmarks/token_budget.py [--answers 64 256 1024] [--answer-len 2048]
                                      [--budget 4096]

Each rollout is `--answers` answers as `GRPOTrainer.train_grpo` hands them to the actor
(`grpo_packing.skewed_rollout`: prompts of 16..64 tokens, answer lengths with mean / max about
0.3, up to `--answer-len`), packed (`zeroxla.rlhf.packed_rollout.pack_for_step`) two ways for
the same ZeRO-3 step (llama-small, the GRPO dapo loss, mesh 2 x 4 simulated CPU devices):
"whole", rows of the longest sequence's slots, every row of a replica in one micro-batch
(`--no` budget, the default); "budget", rows of `--budget` tokens, each replica's rows its
micro-batches (`gradient_accumulation_steps` = rows per replica). Bytes are the compiled
program's `memory_analysis()` per device: temporaries, and the peak (arguments + outputs -
aliased + temporaries, as `zeroxla.memory_report`'s estimate). The state is abstract.
"""

from __future__ import annotations

import argparse
import os
import sys

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import optax  # noqa: E402

import zeroxla  # noqa: E402
from grpo_packing import VOCAB, skewed_rollout  # noqa: E402
from zeroxla import models  # noqa: E402
from zeroxla.analysis.abstract_step import abstract_state  # noqa: E402
from zeroxla.rlhf.grpo.losses import make_grpo_loss  # noqa: E402
from zeroxla.rlhf.packed_rollout import pack_for_step  # noqa: E402

MIB = 2 ** 20
PROMPT_LEN = 64


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--answer-len", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=4096)
    args = parser.parse_args(argv)
    longest = PROMPT_LEN + args.answer_len - 1
    step = zeroxla.make_step(
        lambda: models.build("llama-small", vocab_size=VOCAB, max_seq_len=args.budget),
        zeroxla.make_mesh(2, 4), optimizer=optax.sgd(1e-3),
        loss_fn=make_grpo_loss(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.04),
        config=zeroxla.ZeroConfig(stage=3))
    state = abstract_state(step)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"mesh 2x4, llama-small (vocab {VOCAB}), ZeRO-3, GRPO dapo loss; answers up to "
          f"{args.answer_len} tokens, prompts up to {PROMPT_LEN}; whole rows {longest} slots, "
          f"budget rows {args.budget}")
    header = (f"{'answers':>8}{'tokens':>9}  {'packing':<8}{'rows/replica':>13}"
              f"{'micro-batches':>14}{'temp MiB':>10}{'peak MiB':>10}")
    print(header)
    print("-" * len(header))
    for answers in args.answers:
        padded = skewed_rollout(answers, PROMPT_LEN, args.answer_len, seed=answers)
        tokens = int((padded["prompt_lengths"] + padded["action_mask"].sum(1) - 1).sum())
        for name, budget in (("whole", None), ("budget", args.budget)):
            packed, _, k = pack_for_step(padded, step.layout, loss_type="dapo", row_len=longest,
                                         token_budget=budget, owner="GRPOConfig")
            memory = step.compile(state, packed,
                                  gradient_accumulation_steps=k).memory_analysis()
            peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                    - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
            per_replica = packed["inputs"].shape[0] // step.layout.data_size
            print(f"{answers:>8}{tokens:>9}  {name:<8}{per_replica:>13}{k or 1:>14}"
                  f"{memory.temp_size_in_bytes / MIB:>10.1f}{peak / MIB:>10.1f}",
                  flush=True)


if __name__ == "__main__":
    main()

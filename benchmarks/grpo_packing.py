"""Seconds per GRPO actor step on a length-skewed rollout: packed rows against the padded rows,
the same rollout, the same step, measured side by side in one run.

    python benchmarks/grpo_packing.py [--answers 64] [--prompt-len 64] [--answer-len 448]

The rollout: `--answers` rows as `GRPOTrainer.train_grpo` hands them to the actor (prompt,
answer, zeros), prompts of 16..--prompt-len tokens, answer lengths drawn so that mean / max is
about 0.3 (most reasoning traces far shorter than the longest, as RL rollouts are), random
log-probs and advantages. Padded: one row per answer of prompt + answer columns; packed:
`zeroxla.rlhf.packed_rollout` (rows of the longest sequence's length, balanced over the data
replicas). Both run the GRPO loss (`make_grpo_loss`, dapo, beta 0.04) on llama-small under
ZeRO-3 on 8 simulated CPU devices (mesh 2 x 4), SGD; after one warm-up step each (the
compile), --steps steps of each side alternate, so drift in the machine falls on both.
"""

from __future__ import annotations

import argparse
import os
import time

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zeroxla  # noqa: E402
from zeroxla import models  # noqa: E402
from zeroxla.rlhf.grpo.losses import make_grpo_loss  # noqa: E402
from zeroxla.rlhf.packed_rollout import pack_rollout  # noqa: E402

VOCAB = 256


def skewed_rollout(answers: int, prompt_len: int, answer_len: int, seed: int = 0):
    """The padded training batch of a rollout whose answer lengths have mean / max ~ 0.3."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(16, prompt_len + 1, answers)
    lengths = np.clip(rng.lognormal(np.log(0.22 * answer_len), 0.7, answers), 4,
                      answer_len).astype(int)
    tokens = np.zeros((answers, prompt_len + answer_len), np.int32)
    mask = np.zeros((answers, answer_len), np.float32)
    for b in range(answers):
        n = prompts[b] + lengths[b]
        tokens[b, :n] = rng.integers(1, VOCAB, n)
        mask[b, :lengths[b]] = 1.0
    return {"tokens": tokens, "prompt_lengths": prompts.astype(np.int32),
            "old_logprobs": rng.uniform(-6, -1, mask.shape).astype(np.float32) * mask,
            "ref_logprobs": rng.uniform(-6, -1, mask.shape).astype(np.float32) * mask,
            "advantages": rng.normal(size=answers).astype(np.float32), "action_mask": mask}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--answer-len", type=int, default=448)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    mesh = zeroxla.make_mesh(2, 4)
    padded = skewed_rollout(args.answers, args.prompt_len, args.answer_len)
    answer = padded["action_mask"].sum(1)
    packed, stats = pack_rollout(padded, loss_type="dapo",
                                 row_len=args.prompt_len + args.answer_len - 1, data_size=8)
    real = int((padded["prompt_lengths"] + answer - 1).sum())       # slots holding a token
    step = zeroxla.make_step(lambda: models.build("llama-small", vocab_size=VOCAB,
                                                               max_seq_len=1024), mesh,
                             optimizer=optax.sgd(1e-3),
                             loss_fn=make_grpo_loss(loss_type="dapo", epsilon=0.2,
                                                    epsilon_high=0.28, beta=0.04),
                             config=zeroxla.ZeroConfig(stage=3))
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"mesh 2x4, llama-small (vocab {VOCAB}), ZeRO-3, GRPO dapo loss; {args.answers} "
          f"answers, mean/max answer length {answer.mean() / answer.max():.2f}; padded "
          f"{padded['tokens'].shape[0]} rows x {padded['tokens'].shape[1]}, packed "
          f"{packed['inputs'].shape[0]} rows x {packed['inputs'].shape[1]} "
          f"({int(stats['rows'])} filled, replica imbalance {stats['replica_imbalance']:.2f})")
    sides = {"padded": padded, "packed": packed}
    states = {name: step.init() for name in sides}
    seconds = dict.fromkeys(sides, 0.0)
    for i in range(args.steps + 1):                  # step 0 compiles; then alternating
        for name, batch in sides.items():
            start = time.perf_counter()
            states[name], metrics = step(states[name], batch)
            jax.block_until_ready(metrics)
            if i:
                seconds[name] += time.perf_counter() - start
    header = f"{'rows':<8}{'s/step':>9}{'tokens/s':>10}{'ratio':>7}"
    print(header)
    print("-" * len(header))
    for name in sides:
        per_step = seconds[name] / args.steps
        print(f"{name:<8}{per_step:>9.3f}{real / per_step:>10.0f}"
              f"{seconds['padded'] / seconds[name]:>7.2f}")


if __name__ == "__main__":
    main()

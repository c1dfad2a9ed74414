"""GRPO on the bundled task with the rollout engine (continuous batching, each group's prompt
prefilled once) against the static batch it replaced: the train/rollout log-prob gap per tp and
the generation share of the iteration time, on 8 simulated CPU devices.

    python benchmarks/grpo_rollout.py [--iterations 3] [--tp 1 2 4]

gpt-tiny, SFT'd on the bundled arithmetic task (200 steps, as notebooks/grpo.py), then for each
tp and each engine (`batching="static"`: G generate calls of the padded batch, today's path
before this engine; `batching="continuous"`: `generate_group`) a fresh GRPO trainer (same
seed) runs `--iterations` iterations of 16 prompts x 8 answers. Per row: the gap between the
log-probs the engine drew each token with and the training forward's (`gap/max` over the
iterations, `gap/mean_abs` mean), the rollouts' generated tokens equal between the engines, and
the iteration time split (generation / scoring / training, iterations after the first, which
compiles).
"""

from __future__ import annotations

import argparse
import os

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import numpy as np  # noqa: E402

import zeroxla  # noqa: E402
from zeroxla import models  # noqa: E402
from zeroxla.app.tokenizers.basic import CharTokenizer  # noqa: E402
from zeroxla.rlhf import GRPOConfig  # noqa: E402
from zeroxla.rlhf.grpo import arithmetic_task as task  # noqa: E402
from zeroxla.rlhf.grpo.trainer import GRPOTrainer  # noqa: E402
from zeroxla.rlhf.grpo.reward_funcs import accuracy_reward  # noqa: E402
from zeroxla.rlhf.grpo.task_sft import supervised_finetune_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    mesh = zeroxla.make_mesh(nodes=2, local=4)
    tokenizer = CharTokenizer.from_text(task.ALPHABET)
    eos = int(tokenizer.encode(task.END)[0])
    train, _ = task.split_problems(1000, 128, seed=0, digits=1)
    width = task.prompt_width(1)
    sft_rows = [dict(p, completion=p["completion"] if i % 2 else p["answer"] + task.END)
                for i, p in enumerate(train[:600])]
    actor = models.build("gpt-tiny", vocab_size=tokenizer.vocab_size, max_seq_len=64)
    sft, _ = supervised_finetune_rows(actor, sft_rows, tokenizer, mesh=mesh,
                                      prompt_length=width, completion_length=8, steps=200,
                                      batch_size=32, lr=3e-3)
    config = GRPOConfig(num_generations=8, prompts_per_iteration=16, prompt_length=width,
                        max_completion_length=8, num_iterations=2, learning_rate=1e-3,
                        rollout_correction="tis", tis_cap=2.0)
    print("| tp | engine | gap max | gap mean abs | generation s | scoring s | training s | "
          "generation share | prompt tokens prefilled |\n|---|---|---|---|---|---|---|---|---|")
    for tp in args.tp:
        tokens = {}
        for batching in ("static", "continuous"):
            trainer = GRPOTrainer(config, sft, mesh=mesh, tokenizer=tokenizer,
                                  prompts=train[600:], reward_funcs=[accuracy_reward],
                                  inference_tp_size=tp, eos_id=eos, seed=0)
            trainer.engine = zeroxla.HybridEngine(trainer.actor_step.layout,
                                                  trainer.engine.config.replace(
                                                      batching=batching))
            records, rollouts = zip(*(trainer.iteration(it) for it in range(args.iterations)))
            tokens[batching] = [r.tokens for r in rollouts]
            timed = records[1:] or records
            times = {k: float(np.mean([r[k] for r in timed]))
                     for k in ("generation_s", "scoring_s", "training_s")}
            prefill = (f"{records[-1]['generation/prefill_tokens']:.0f}"
                       if "generation/prefill_tokens" in records[-1]
                       else f"{config.num_generations * config.prompts_per_iteration * width}")
            print(f"| {tp} | {batching} | {max(r['gap/max'] for r in records):.1e} | "
                  f"{np.mean([r['gap/mean_abs'] for r in records]):.1e} | "
                  f"{times['generation_s']:.3f} | {times['scoring_s']:.3f} | "
                  f"{times['training_s']:.3f} | "
                  f"{times['generation_s'] / sum(times.values()):.2f} | {prefill} |")
        same = all(np.array_equal(a, b) for a, b in zip(tokens["static"], tokens["continuous"]))
        print(f"|   | rollouts' tokens equal between the engines: {same} | | | | | | | |")


if __name__ == "__main__":
    main()

"""RLHF with PPO on zeroxla, shaped like DeepSpeed-Chat's step 3 (`zeroxla.rlhf`).

    python examples/rlhf_ppo.py --iterations 20 --out rlhf_ppo.png

A tiny GPT is first fine-tuned on tiny-shakespeare (DeepSpeed-Chat's step 1, shortened), then
PPO raises a programmatic reward, the fraction of vowels in its continuations: each iteration
generates answers with the Hybrid Engine, scores them, computes KL-penalised rewards and GAE
advantages, and trains actor and critic under ZeRO-3 (2 nodes x 4 simulated CPU devices).
Prints reward and KL per iteration and the time split between generation and training, and
writes a plot of both to --out.
"""

import argparse
import os
import time

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _simulate_devices(count: int = 8) -> None:
    """8 host CPU devices for the 2 x 4 mesh; must happen before JAX starts a backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={count}".strip()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20, help="PPO iterations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="rlhf_ppo.png", help="the reward/KL plot (png)")
    parser.add_argument("--sft-steps", type=int, default=100,
                        help="supervised steps on tiny-shakespeare before PPO")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per iteration")
    parser.add_argument("--tp", type=int, default=2, help="Hybrid Engine inference_tp_size")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error(f"--iterations {args.iterations} is invalid; accepted: an integer >= 1")

    _simulate_devices()
    import matplotlib
    matplotlib.use("Agg")
    import numpy as np

    import zeroxla
    from zeroxla import rlhf
    from zeroxla.app import data
    from zeroxla.app.char_sft import supervised_finetune

    start = time.perf_counter()
    corpus = data.load_corpus()
    mesh = zeroxla.make_mesh(nodes=2, local=4)
    config = rlhf.PPOConfig.vowels_demo().replace(prompts_per_iteration=args.prompts)
    actor, sft_loss = supervised_finetune(mesh=mesh, steps=args.sft_steps, seed=args.seed)
    print(f"supervised fine-tune: {args.sft_steps} steps, loss {sft_loss:.3f}")
    print(f"PPO: {config}")

    def report(r):
        print(f"iter {r['iteration']:3d}  reward {r['reward']:.4f}  kl {r['kl']:.4f}  "
              f"actor_loss {r['actor_loss']:+.4f}  critic_loss {r['critic_loss']:.4f}  "
              f"gen {r['generation_s']:.2f}s  exp {r['experience_s']:.2f}s  "
              f"train {r['training_s']:.2f}s", flush=True)

    run = rlhf.run_ppo(config, args.iterations, actor, mesh=mesh, tokenizer=corpus.tokenizer,
                       prompt_tokens=corpus.val, inference_tp_size=args.tp, seed=args.seed,
                       on_iteration=report)
    records = run.records
    split = rlhf.time_split(records)
    print(f"time after iteration 0 (which compiles): generation {split['generation_s']:.1f}s "
          f"({split['generation_share']:.0%}), experience {split['experience_s']:.1f}s "
          f"({split['experience_share']:.0%}), training {split['training_s']:.1f}s "
          f"({split['training_share']:.0%})")
    first, last = run.rollouts[0], run.rollouts[-1]
    k = max(1, min(3, len(records) // 2))
    print(f"reward: first {k} iterations {np.mean([r['reward'] for r in records[:k]]):.4f}, "
          f"last {k} {np.mean([r['reward'] for r in records[-k:]]):.4f}")
    print(f"answer before PPO: {first.texts[0]!r}\nanswer after PPO:  {last.texts[0]!r}")

    fig = rlhf.plot_records(records)
    fig.savefig(args.out, dpi=100)
    print(f"plot: {args.out}; total {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()

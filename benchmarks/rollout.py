"""The rollout engine: continuous batching over a paged KV cache against today's static batch,
at equal KV bytes, on a length-skewed workload; and prefix sharing for GRPO groups.

    python benchmarks/rollout.py [--prompts 256] [--batch 16] [--max-new 192]
                                 [--slots 40] [--budget 48] [--page 16] [--groups 8]
                                 [--repeats 3] [--model Qwen2.5-0.5B]

One device, one Llama (4 layers, d_model 256, 8 heads, 4 KV heads, vocabulary 512) in a ZeRO-3
step; the Hybrid Engine generates (temperature 1, seed fixed) from its training state:

* workload: `--prompts` prompts of 16..64 tokens; each row's response length drawn from an
  exponential of mean 0.46 x max-new cut at max-new (an RL rollout's long tail and its
  truncated answers, ~10% of them; mean / max = 0.39, as a verl log's 1,267 / 3,072), EOS
  forced there (the row's own max_new_tokens);
* `static`: `batching="static"`, batches of `--batch` rows in order, each decoding until its
  longest row ends (the static loop's rule), KV cache batch x max_out_tokens slots;
* `continuous`: `batching="continuous"`, every prompt queued at once, `--slots` sequences and
  `--budget` token places a step, KV pool of batch x max_out_tokens / page pages (equal bytes).

Tokens/s counts each row's drawn new tokens only (what a rollout keeps), median of 3 timed runs
after a warm-up, the two engines' runs alternating; both engines' outputs are checked equal row
by row. Then: KV bytes per
live token (pages in use x page / tokens in the cache, averaged over steps) against the ideal
at that page size (each sequence's tokens rounded up to whole pages), the step executable's
compile count over the whole timed run (jax.monitoring's backend-compile events), and GRPO's
shape (`--groups` prompts x 8 answers): prompt tokens prefilled with prefix sharing
(`generate_group`) and without (8 generate calls), and whether the answers are those of the
separate calls.
The line `continuous / static tokens/s: R` closes the comparison. `--model Qwen2.5-0.5B`: the
same workload at a real width (random weights), for a GPU; `--repeats 1 --groups 0` keep its
device time short.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.inference import HybridEngine, HybridEngineConfig


def build(max_out: int, preset: str | None = None):
    """The step and its state: the small Llama, or `preset` (a `models.presets` name: a real
    width, random weights; token ids stay below 512 either way)."""
    if preset:
        from zeroxla.models import presets
        config = presets.config(preset).replace(max_seq_len=max_out)
    else:
        config = models.LlamaConfig(vocab_size=512, max_seq_len=max_out, d_model=256,
                                    num_heads=8, num_kv_heads=4, num_layers=4, mlp_dim=688,
                                    init_std=0.05)
    cls = models.model_class(config)
    step = zeroxla.make_step(lambda: cls(config, rngs=nnx.Rngs(0)),
                             zeroxla.make_mesh(1, 1, devices=jax.devices()[:1]),
                             optimizer=optax.sgd(0.0), config=zeroxla.ZeroConfig(stage=3))
    return step, step.init()


def workload(args, rng):
    prompts = [rng.integers(0, 512, rng.integers(16, 65)).astype(np.int32)
               for _ in range(args.prompts)]
    drawn = rng.exponential(0.46 * args.max_new, args.prompts)   # a long tail, cut at the
    news = np.clip(np.round(drawn), 1, args.max_new).astype(int)  # limit (~10% reach it)
    return prompts, [int(n) for n in news]


def timed(runs, compiles, repeats=3):
    """For each of `runs` (callables): (median seconds of `repeats` runs after a warm-up, the
    output, backend compiles during its timed runs). The runs alternate, so a change in the
    shared machine's load falls on every side."""
    outs = [run() for run in runs]                                # compile, warm up
    times, counts = [[] for _ in runs], [0] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            before, start = compiles.count, time.perf_counter()
            run()
            times[i].append(time.perf_counter() - start)
            counts[i] += compiles.count - before
    return [(statistics.median(t), out, n) for t, out, n in zip(times, outs, counts)]


class CompileCount:
    """Backend compiles seen by jax.monitoring while active."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=192)
    parser.add_argument("--slots", type=int, default=40)
    parser.add_argument("--budget", type=int, default=48)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8, help="0: skip the GRPO-group part")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each engine")
    parser.add_argument("--model", default=None,
                        help="a models.presets name (e.g. Qwen2.5-0.5B) instead of the small "
                             "Llama")
    args = parser.parse_args()
    max_out = 64 + args.max_new
    step, state = build(max_out, args.model)
    prompts, news = workload(args, np.random.default_rng(0))
    print(f"{args.prompts} prompts of 16..64 tokens, new tokens {np.mean(news):.1f} mean / "
          f"{max(news)} max (ratio {np.mean(news) / max(news):.2f}); KV {args.batch} x "
          f"{max_out} slots both ways; {jax.devices()[0].platform}")

    static = HybridEngine(step.layout, HybridEngineConfig(max_out_tokens=max_out,
                                                          batching="static"))
    pages = args.batch * max_out // args.page
    engine = HybridEngine(step.layout, HybridEngineConfig(
        max_out_tokens=max_out, batching="continuous", kv_block_size=args.page,
        max_ragged_batch_size=args.budget, max_ragged_sequence_count=args.slots,
        kv_blocks=pages))
    kw = dict(temperature=1.0, seed=7)

    def run_static():
        out = []
        for i in range(0, len(prompts), args.batch):
            out += static.generate(state, prompts[i:i + args.batch],
                                   max_new_tokens=news[i:i + args.batch], **kw)
        return out

    compiles = CompileCount()
    (static_s, static_out, static_compiles), (cont_s, cont_out, recompiles) = timed(
        [run_static, lambda: engine.generate(state, prompts, max_new_tokens=news, **kw)],
        compiles, args.repeats)
    same = all(np.array_equal(a, b) for a, b in zip(static_out, cont_out))
    stats = engine.stats
    tokens = sum(news)
    print(f"outputs equal row by row: {same}")
    print("| engine | tokens/s | steps | KV slots | notes |\n|---|---|---|---|---|")
    print(f"| static (batch {args.batch}) | {tokens / static_s:,.0f} | "
          f"{sum(max(news[i:i + args.batch]) for i in range(0, len(news), args.batch))} | "
          f"{args.batch * max_out:,} | each batch decodes to its longest row |")
    print(f"| continuous ({args.slots} slots, {args.budget} places) | {tokens / cont_s:,.0f} | "
          f"{stats['steps']} | {pages * args.page:,} | peak pages {stats['peak_pages_in_use']}"
          f" of {pages - 1}, preemptions {stats['preemptions']} |")
    print(f"continuous: {stats['program_seconds'] / stats['steps'] * 1e3:.2f} ms a step in the "
          f"step program (call to tokens on the host), "
          f"{(stats['seconds'] - stats['program_seconds']) / stats['steps'] * 1e3:.2f} ms on "
          f"the host (scheduling, packing)")
    live = sum(p.size + n for p, n in zip(prompts, news)) / len(news)    # a row's last length
    print(f"KV bytes per live token (pages in use x {args.page} / tokens in the cache, mean over "
          f"steps): {stats['kv_slots_per_live_token']:.3f} token's worth (static: "
          f"{max_out / live:.2f} at the end of each row)")
    print(f"backend compiles during the {args.repeats} timed runs: continuous {recompiles}, static "
          f"{static_compiles} (the warm-up compiled each engine's programs: continuous one step "
          f"executable, static one per (batch, prompt) bucket)")

    print(f"continuous / static tokens/s: {static_s / cont_s:.2f}")
    if args.groups:
        grpo_groups(args, engine, state, prompts)


def grpo_groups(args, engine, state, prompts):
    """GRPO's shape: prefill with prefix sharing against separate calls."""
    g = 8
    picked = prompts[:args.groups]
    seeds = list(range(g))
    shared = engine.generate_group(state, picked, seeds, max_new_tokens=32, temperature=1.0)
    shared_prefill = engine.stats["prefill_tokens"]
    alone = [engine.generate(state, picked, max_new_tokens=32, temperature=1.0, seed=s)
             for s in seeds]
    alone_prefill = sum(p.size for p in picked) * g
    same_groups = all(np.array_equal(a, b) for x, y in zip(shared, alone) for a, b in zip(x, y))
    print(f"GRPO groups ({args.groups} prompts x {g} answers): prompt tokens prefilled "
          f"{shared_prefill} shared vs {alone_prefill} separate "
          f"({alone_prefill / shared_prefill:.1f}x); answers equal to separate calls: "
          f"{same_groups}")


if __name__ == "__main__":
    main()

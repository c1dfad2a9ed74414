"""Tokens per second of supervised fine-tuning on a length-skewed set: packed rows against
padded rows, the same examples, the same step, measured side by side in one run.

    python benchmarks/packing.py [--examples 512] [--seq-len 256] [--steps 6]

The set: example lengths drawn so that mean / max is about 0.4 (most examples far shorter than
the longest, as chat SFT data is), the loss on each example's second half. Padded: one example
per row of --seq-len tokens (`chat_data.sft_arrays`' layout); packed: first-fit decreasing rows
with segment ids (`zeroxla.app.packing`). Both train a Llama-shaped model (llama-small) under
ZeRO-3 on 8 simulated CPU devices (mesh 2 x 4), 16 rows per step; tokens per second counts
the examples' tokens only (padding is not work done), over --steps steps after one warm-up
step (the compile), the two sides' steps alternating.
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
from zeroxla.app import packing  # noqa: E402

ROWS = 16


def skewed_examples(n: int, seq_len: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """`n` (tokens, learned) examples of 8..seq_len tokens to predict, mean / max ~ 0.4 (a
    log-normal body, clipped), learned from the middle on."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(0.35 * seq_len), 0.6, n), 8, seq_len).astype(int)
    out = []
    for k in lengths:
        tokens = rng.integers(0, 256, k + 1).astype(np.int32)
        out.append((tokens, np.arange(k + 1) > k // 2))
    return out


def padded_rows(examples, seq_len: int) -> dict[str, np.ndarray]:
    n = len(examples)
    rows = {"inputs": np.zeros((n, seq_len), np.int32), "targets": np.zeros((n, seq_len), np.int32),
            "loss_mask": np.zeros((n, seq_len), np.float32)}
    for i, (tokens, learned) in enumerate(examples):
        k = len(tokens) - 1
        rows["inputs"][i, :k], rows["targets"][i, :k] = tokens[:-1], tokens[1:]
        rows["loss_mask"][i, :k] = learned[1:]
    return rows


class Trainer:
    """One side of the comparison: its step, state and batches of ROWS rows; `filled` int[R]:
    the example tokens each row holds."""

    def __init__(self, rows: dict[str, np.ndarray], filled: np.ndarray, mesh):
        self.step = zeroxla.make_step(lambda: models.build("llama-small", vocab_size=256), mesh,
                                      optimizer=optax.adamw(1e-4),
                                      config=zeroxla.ZeroConfig(stage=3))
        self.state = self.step.init()
        n = len(rows["inputs"]) // ROWS
        self.batches = [{k: v[i * ROWS:(i + 1) * ROWS] for k, v in rows.items()}
                        for i in range(n)]
        self.tokens = [int(np.sum(filled[i * ROWS:(i + 1) * ROWS])) for i in range(n)]
        self.seconds, self.done, self.real = 0.0, 0, 0
        self.train(0, timed=False)                          # compile + warm-up

    def train(self, i: int, timed: bool = True) -> None:
        start = time.perf_counter()
        self.state, metrics = self.step(self.state, self.batches[i])
        jax.block_until_ready(metrics)
        if timed:
            self.seconds += time.perf_counter() - start
            self.done += 1
            self.real += self.tokens[i]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    examples = skewed_examples(args.examples, args.seq_len)
    lengths = np.array([len(t) - 1 for t, _ in examples])
    padded = padded_rows(examples, args.seq_len)
    packed = packing.pack(examples, args.seq_len, pad_id=0)
    mesh = zeroxla.make_mesh(2, 4)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"mesh 2x4, llama-small (vocab 256), ZeRO-3, AdamW, {ROWS} rows x {args.seq_len} "
          f"tokens per step; {len(examples)} examples, mean/max length "
          f"{lengths.mean() / lengths.max():.2f}; padded {len(padded['inputs'])} rows, packed "
          f"{len(packed['inputs'])} rows")
    sides = {"padded": Trainer(padded, lengths, mesh),
             "packed": Trainer(packed, np.sum(packed["segment_ids"] > 0, -1), mesh)}
    for i in range(1, args.steps + 1):         # alternating, so drift in the machine is shared
        for side in sides.values():
            side.train(i)
    results = {name: (side.real / side.seconds, side.seconds / side.done)
               for name, side in sides.items()}
    header = f"{'rows':<8}{'tokens/s':>10}{'s/step':>9}{'ratio':>7}"
    print(header)
    print("-" * len(header))
    for name, (tps, sps) in results.items():
        print(f"{name:<8}{tps:>10.0f}{sps:>9.3f}{tps / results['padded'][0]:>7.2f}")


if __name__ == "__main__":
    main()

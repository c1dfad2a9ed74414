"""The Hybrid Engine's decode against the card's memory-bandwidth floor.

    python benchmarks/gpu/decode_floor.py [--model Qwen2.5-0.5B] [--rows 32] [--new 64] [--tiny]

A ZeRO-3 step of `--model` (a `models.presets` shape, random weights) on a 1 x 1 mesh; the
engine (`batching="static"`, `inference_tp_size=1`) continues `--rows` prompts of 16 tokens
greedily. One decode step's seconds = (time of 1 + `--new` new tokens - time of 1 new token) /
`--new` (the prefill and the first token cancel), medians of 3 after a warm-up; decode
tokens/s = rows / that.

The floor: a decode step must read every weight once (the engine decodes in float32: 4 bytes a
parameter) and each row's keys and values so far (2 x layers x KV heads x head dim x 4 bytes a
token, at the mean length over the decode); floor tokens/s = rows x bandwidth / those bytes,
with the bandwidth measured in the same process (`y = x * 2` over 2 GiB of float32: bytes read
+ written / median seconds). The ratio says how close decode runs to what the card's memory
allows.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import common
import zeroxla
from zeroxla import models
from zeroxla.inference import HybridEngine, HybridEngineConfig
from zeroxla.models import presets

SECTION = "decode_floor"
PROMPT = 16


def bandwidth(gib: float) -> float:
    """Bytes/s of `x * 2` over `gib` GiB of float32 (read + written)."""
    x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    double = jax.jit(lambda a: a * 2)
    seconds = common.median_seconds(lambda: double(x), warmup=2, repeats=10)
    return 2 * x.nbytes / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen2.5-0.5B")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help=common.TINY_HELP)
    args = parser.parse_args()
    config = presets.config(args.model)
    if args.tiny:
        config = config.replace(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                                mlp_dim=128, vocab_size=512)
        args.rows, args.new = 4, 8
    max_out = PROMPT + args.new + 1
    config = config.replace(max_seq_len=max_out)
    cls = models.model_class(config)
    step = zeroxla.make_step(lambda: cls(config, rngs=nnx.Rngs(0)),
                             zeroxla.make_mesh(1, 1, devices=jax.devices()[:1]),
                             optimizer=optax.sgd(0.0), config=zeroxla.ZeroConfig(stage=3))
    state = step.init()
    engine = HybridEngine(step.layout, HybridEngineConfig(max_out_tokens=max_out,
                                                          batching="static"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, PROMPT).astype(np.int32) for _ in range(args.rows)]
    times = {n: common.median_seconds(lambda n=n: engine.generate(state, prompts, n),
                                      warmup=1, repeats=3) for n in (1, 1 + args.new)}
    step_s = (times[1 + args.new] - times[1]) / args.new
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(models.abstract_model(config),
                                                             nnx.Param)))
    head_dim = config.explicit_head_dim or config.d_model // config.num_heads
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * head_dim * 4
    mean_len = PROMPT + 1 + args.new / 2
    step_bytes = 4 * n_params + args.rows * mean_len * kv_per_token
    bw = bandwidth(0.01 if args.tiny else 2.0)
    floor = args.rows * bw / step_bytes
    common.record(SECTION, model=args.model, rows=args.rows, new_tokens=args.new,
                  params=n_params, step_s=step_s, decode_tokens_per_s=args.rows / step_s,
                  prefill_and_first_token_s=times[1], bytes_per_step=step_bytes,
                  measured_bandwidth_bytes_per_s=bw, floor_tokens_per_s=floor,
                  fraction_of_floor=args.rows / step_s / floor)


if __name__ == "__main__":
    main()

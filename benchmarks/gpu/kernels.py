"""Throughput of the ZeRO++ quantization kernels against the device's copy bandwidth, one run.

    python benchmarks/gpu/kernels.py [--mib 256] [--tiny]

Kernels (`zeroxla.pallas_kernels`), each as the Pallas kernel (`impl="pallas"`: compiled on a
GPU, interpreted elsewhere) and as the jnp path XLA fuses (`impl="jnp"`):

* quantize:            float32 [n] -> int8 codes, groups of 2048 (qwZ: DeepSpeed's default)
* dequantize:          int8 codes + steps -> float32 [n]
* swizzled_quantize:   float32 [n] -> int4 codes in qgZ's [local, node] layout (2 x 4 devices)
* dequant_reduce:      4 stacked int4 tensors of n / 4 -> their float32 sum, requantized to int4
* dequant_sum:         the same 4 -> the float32 sum

GB/s = (bytes read + bytes written) / median seconds, 1 GB = 1e9 bytes: codes, steps and
offsets as stored (`QuantizedArray.nbytes`), float32 values at 4 bytes. The reference is the
same measure of a device-to-device copy (`jnp.copy`, jitted) and of an elementwise `x * 2`
over the same float32 input, in the same process. Each timed run is 10 calls issued back to
back and then waited for (one Python dispatch does not hide a 0.2 ms kernel); the median of 10
such runs after 2 warm-up runs. The Pallas result is compared with the jnp one before it is
timed (`pallas_equals_jnp`): codes and steps bit-equal for the quantizers and dequantize; for
the reductions, which sum in float32 in another order, within the kernel tests' bounds
(`sums_agree`). A fast wrong kernel is reported as wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

import common
from zeroxla import pallas_kernels as pk

SECTION = "kernels"
GROUP = 2048
NODES, LOCAL = 2, 4                 # qgZ's two hops on a 2-node x 4-device mesh
PEERS = LOCAL                       # contributions dequant_reduce sums (one per local peer)
CALLS = 10


def timed_gbps(fn, args, moved_bytes: int, repeats: int) -> tuple[float, float]:
    """(GB/s, median seconds per call) of `fn(*args)`, CALLS calls per timed run."""
    def run():
        return [fn(*args) for _ in range(CALLS)]
    for _ in range(2):
        jax.block_until_ready(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append((time.perf_counter() - start) / CALLS)
    seconds = statistics.median(times)
    return moved_bytes / seconds / 1e9, seconds


def bit_equal(a: pk.QuantizedArray | jax.Array, b: pk.QuantizedArray | jax.Array) -> bool:
    """Codes, steps and offsets bit-equal (NaN equal to NaN), or arrays equal."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
    return all(bool(jnp.array_equal(x, y, equal_nan=True)) for x, y in pairs)


def sums_agree(got, expected, stacked: pk.QuantizedArray) -> bool:
    """The kernel and the jnp path sum the PEERS contributions in float32 in different orders
    (tests/pallas_kernels/test_dequant_reduce.py's bounds): float32 sums within PEERS roundings
    of the largest sum of |terms|; requantized sums (dequant_reduce) at most one step apart on
    at most 0.1% of the elements, steps within (4 + PEERS) float32 roundings."""
    eps = float(jnp.finfo(jnp.float32).eps)
    terms = jnp.max(jnp.sum(jnp.abs(pk.dequantize(stacked, impl="jnp")), axis=0))
    if not isinstance(got, pk.QuantizedArray):
        return bool(jnp.max(jnp.abs(got - expected)) <= 2 * PEERS * eps * terms)
    flips = jnp.abs(codes(got) - codes(expected))
    steps_close = jnp.max(jnp.abs(got.scales - expected.scales)
                          / jnp.abs(expected.scales)) <= (4 + PEERS) * eps
    return bool((jnp.max(flips) <= 1) & (jnp.mean(flips) < 1e-3) & steps_close)


def codes(q: pk.QuantizedArray) -> jax.Array:
    """The integer codes of a symmetric `q`, as float32 of its logical shape."""
    return pk.dequantize(dataclasses.replace(q, scales=jnp.ones_like(q.scales)), impl="jnp")


def cases(n: int, key: jax.Array) -> dict[str, tuple]:
    """name -> (function of impl, arguments, bytes read + written)."""
    x = jax.random.normal(key, (n,), jnp.float32)
    q8 = pk.quantize(x, bits=8, group_size=GROUP, impl="jnp")
    # What qgZ's first hop hands each device: PEERS = LOCAL contributions, each [NODES, chunk],
    # stacked on a leading axis (data [LOCAL, NODES, G, packed]).
    q4 = pk.swizzled_quantize(x, bits=4, group_size=GROUP, nodes=NODES, devices_per_node=LOCAL,
                              impl="jnp")
    reduced = pk.dequant_reduce(q4, impl="jnp")
    fx = x.nbytes
    return {
        "quantize_int8": (lambda impl, a: pk.quantize(a, bits=8, group_size=GROUP, impl=impl),
                          (x,), fx + q8.nbytes),
        "dequantize_int8": (lambda impl, q: pk.dequantize(q, impl=impl), (q8,), q8.nbytes + fx),
        "swizzled_quantize_int4": (
            lambda impl, a: pk.swizzled_quantize(a, bits=4, group_size=GROUP, nodes=NODES,
                                                 devices_per_node=LOCAL, impl=impl),
            (x,), fx + q4.nbytes),
        "dequant_reduce_int4": (lambda impl, q: pk.dequant_reduce(q, impl=impl), (q4,),
                                q4.nbytes + reduced.nbytes),
        "dequant_sum_int4": (lambda impl, q: pk.dequant_sum(q, impl=impl), (q4,),
                             q4.nbytes + 4 * (n // PEERS)),      # float32 [NODES, chunk] out
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=256.0, help="float32 input size, MiB")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help=common.TINY_HELP)
    args = parser.parse_args()
    mib, repeats = (1.0, 2) if args.tiny else (args.mib, args.repeats)
    unit = GROUP * NODES * LOCAL * PEERS
    n = max(unit, int(mib * 2**20 / 4) // unit * unit)
    print(f"{jax.devices()[0]}, float32 input of {n * 4 / 2**20:.0f} MiB ({n} elements), "
          f"groups of {GROUP}", flush=True)
    x = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
    rows = []
    for name, fn in (("copy", jax.jit(jnp.copy)), ("x*2", jax.jit(lambda a: a * 2))):
        gbps, seconds = timed_gbps(fn, (x,), 2 * x.nbytes, repeats)
        rows.append(common.record(SECTION, kernel=name, impl="xla", bytes=2 * x.nbytes,
                                  seconds=seconds, gbps=round(gbps, 1)))
    del x
    built = common.guarded(SECTION, "inputs", lambda: cases(n, jax.random.key(0)))
    for name, (fn, inputs, moved) in (built or {}).items():
        def measure(name=name, fn=fn, inputs=inputs, moved=moved):
            expected = fn("jnp", *inputs)
            got = fn("pallas", *inputs)
            equal = (sums_agree(got, expected, inputs[0]) if name.startswith("dequant_")
                     and name != "dequantize_int8" else bit_equal(got, expected))
            del got, expected
            for impl in ("pallas", "jnp"):
                gbps, seconds = timed_gbps(lambda *a: fn(impl, *a), inputs, moved, repeats)
                rows.append(common.record(
                    SECTION, kernel=name, impl=impl, bytes=moved, seconds=seconds,
                    gbps=round(gbps, 1), pallas_equals_jnp=equal if impl == "pallas" else None))
        common.guarded(SECTION, name, measure)
    copy = max(r["gbps"] for r in rows[:2])
    print(f"\n| kernel | impl | GB/s | of copy GB/s ({copy}) | pallas == jnp |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['impl']} | {r['gbps']} | {r['gbps'] / copy:.2f} | "
              f"{r.get('pallas_equals_jnp', '')} |")


if __name__ == "__main__":
    main()

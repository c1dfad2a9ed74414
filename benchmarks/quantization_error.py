"""Quantization error of ZeRO++'s block quantization vs group size, bits and data.

Prints relative L1 (sum |x - x'| / sum |x|) and L2 (||x - x'|| / ||x||) errors of
quantize -> dequantize for int8 / int4, symmetric / asymmetric, group sizes 128..8192 and one
group per tensor, on three kinds of data: Gaussian, heavy-tailed Student-t (df=2), and Gaussian
with 0.01% outliers at +-100 sigma (the case ZeRO++ §3.1 makes block quantization for).

    python benchmarks/quantization_error.py [--size 1048576]

`error_rows()` returns the numbers for other benchmarks (benchmarks/zeropp.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402

from zeroxla.pallas_kernels import dequantize, quantize  # noqa: E402

GROUP_SIZES = (128, 512, 2048, 8192)
KINDS = ((8, True), (8, False), (4, True), (4, False))
DATA = ("gaussian", "student-t(2)", "gaussian+0.01%outliers")
PER_TENSOR = None  # group_size value meaning "one group for the whole tensor"


@dataclasses.dataclass(frozen=True)
class ErrorRow:
    data: str
    bits: int
    symmetric: bool
    group_size: int | None  # None: per-tensor
    rel_l1: float
    rel_l2: float
    bits_per_element: float  # on the wire: codes plus float32 scales (and offsets)


def make_data(kind: str, size: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        return rng.standard_normal(size).astype(np.float32)
    if kind == "student-t(2)":
        return rng.standard_t(2, size).astype(np.float32)
    if kind == "gaussian+0.01%outliers":
        x = rng.standard_normal(size).astype(np.float32)
        hits = rng.choice(size, size=max(1, size // 10_000), replace=False)
        x[hits] = rng.choice([-100.0, 100.0], size=hits.size)
        return x
    raise ValueError(f"data kind {kind!r} is not one of {DATA}")


def error_rows(size: int = 1 << 20, group_sizes=GROUP_SIZES, data=DATA, kinds=KINDS,
               impl: str = "auto", seed: int = 0) -> list[ErrorRow]:
    """One row per (data, bits, symmetric, group size or per-tensor)."""
    rows = []
    for kind in data:
        x = make_data(kind, size, seed)
        x64, xj = x.astype(np.float64), jnp.asarray(x)
        for bits, symmetric in kinds:
            for group_size in (*group_sizes, PER_TENSOR):
                gs = size if group_size is PER_TENSOR else group_size
                q = quantize(xj, bits=bits, group_size=gs, symmetric=symmetric, impl=impl)
                err = np.asarray(dequantize(q, impl=impl), np.float64) - x64
                params = 1 if symmetric else 2
                rows.append(ErrorRow(
                    data=kind, bits=bits, symmetric=symmetric, group_size=group_size,
                    rel_l1=float(np.abs(err).sum() / np.abs(x64).sum()),
                    rel_l2=float(np.linalg.norm(err) / np.linalg.norm(x64)),
                    bits_per_element=bits + 32 * params / gs))
    return rows


def format_table(rows: list[ErrorRow]) -> str:
    """One line per (data, bits, symmetric); a "L1 / L2" column per group size, in percent."""
    sizes = sorted({r.group_size for r in rows if r.group_size is not None})
    columns = [*(f"g={g}" for g in sizes), "per-tensor"]
    head = f"{'data':<24}{'quant':<11}" + "".join(f"{c:>17}" for c in columns)
    lines = ["relative error of quantize -> dequantize, L1 % / L2 %", head, "-" * len(head)]
    keys = dict.fromkeys((r.data, r.bits, r.symmetric) for r in rows)
    for data, bits, symmetric in keys:
        cells = {r.group_size: r for r in rows
                 if (r.data, r.bits, r.symmetric) == (data, bits, symmetric)}
        quant = f"int{bits}-{'sym' if symmetric else 'asym'}"
        line = f"{data:<24}{quant:<11}"
        for g in (*sizes, PER_TENSOR):
            r = cells[g]
            line += f"{100 * r.rel_l1:>8.3f} /{100 * r.rel_l2:>7.3f}"
        lines.append(line)
    wire = ", ".join(f"g={g}: +{32 / g:.3f}" for g in sizes)
    lines.append(f"scale overhead in bits per element (symmetric; x2 asymmetric): {wire}")
    return "\n".join(lines)


def main(argv=None) -> list[ErrorRow]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1 << 20, help="elements per tensor")
    parser.add_argument("--impl", default="auto", choices=("auto", "pallas", "jnp"))
    args = parser.parse_args(argv)
    rows = error_rows(size=args.size, impl=args.impl)
    print(f"{args.size} elements per tensor")
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()

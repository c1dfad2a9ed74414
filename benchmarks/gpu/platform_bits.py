"""Where the GPU's quantization differs from the CPU's in bits: `quantize` (jnp path) of the
golden input of tests/pallas_kernels/test_quantize.py on both backends of one process
(JAX_PLATFORMS=cuda,cpu), per group of 256: codes differing, scales / offsets differing, and
the values of the first groups that differ.

    JAX_PLATFORMS=cuda,cpu python benchmarks/gpu/platform_bits.py
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "tests/pallas_kernels")
from test_quantize import KINDS, golden_input  # noqa: E402

from zeroxla.pallas_kernels.quantization import quantize  # noqa: E402


def run(device, bits, symmetric):
    x = jax.device_put(jnp.asarray(golden_input()), device)
    q = quantize(x, bits=bits, group_size=256, symmetric=symmetric, impl="jnp")
    return {k: np.asarray(getattr(q, k)) for k in ("data", "scales", "offsets")
            if getattr(q, k, None) is not None}


def main():
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    for bits, symmetric in KINDS:
        g, c = run(gpu, bits, symmetric), run(cpu, bits, symmetric)
        for key in g:
            a, b = g[key].reshape(-1), c[key].reshape(-1)
            diff = np.nonzero(a.view(np.uint8) != b.view(np.uint8))[0] if a.dtype != b.dtype \
                else np.nonzero(a != b)[0]
            print(f"int{bits} {'sym' if symmetric else 'asym'} {key} {a.shape} {a.dtype}: "
                  f"{diff.size} differ; first {diff[:8].tolist()}; gpu {a[diff[:4]].tolist()} "
                  f"cpu {b[diff[:4]].tolist()}", flush=True)


if __name__ == "__main__":
    main()

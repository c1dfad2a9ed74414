"""XLA compile time of one ZeRO-3 step with and without Python tracebacks in its MLIR locations.

JAX writes up to `jax_traceback_in_locations_limit` frames (100 by default) of the call stack that
traced each op into the op's location; XLA carries them as source metadata through every pass.
The test suite sets the limit to 0 (tests/support/xla_flags.py). This measures what that saves
on a Gemma 3 step under ZeRO-3 on 2 x 4 (2 periods of 6 layers, AdamW), with the suite's XLA:CPU
codegen flags, each program lowered from a fresh `make_step` and compiled without a cache, the
two limits alternating; and checks that the optimized HLO is the same but for metadata.

    python benchmarks/compile_locations.py [--reps 4]
"""

import argparse
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
import xla_flags  # noqa: E402  (the suite's codegen flags, read without starting JAX's backend)

os.environ["XLA_FLAGS"] = f"{xla_flags.CODEGEN_FLAGS} {xla_flags.DEVICE_COUNT_FLAG}=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import zeroxla  # noqa: E402
from zeroxla import models  # noqa: E402

LIMITS = (100, 0)       # JAX's default, the suite's


def _step():
    config = models.Gemma3Config(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2,
                                 mlp_dim=64, num_layers=2, sliding_window=4,
                                 sliding_window_pattern=6)
    return zeroxla.make_step(models.Gemma3(config, rngs=nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adamw(1e-3),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))


def _without_metadata(hlo: str) -> str:
    """The module's text without each instruction's metadata and the stack-frame tables
    (FileNames, FunctionNames, FileLocations, StackFrames)."""
    tables = r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n.*?(?=\n\n)"
    text = re.sub(r", metadata=\{[^}]*\}", "", re.sub(tables, "", hlo, flags=re.DOTALL))
    return re.sub(r"\n\n+", "\n\n", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    step = _step()
    state = step.init()
    tokens = np.random.default_rng(0).integers(0, 64, (8, 33)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    seconds, texts = {limit: [] for limit in LIMITS}, {}
    for rep in range(args.reps):
        for limit in (LIMITS if rep % 2 else LIMITS[::-1]):
            jax.config.update("jax_traceback_in_locations_limit", limit)
            lowered = _step().lower(state, batch)
            start = time.perf_counter()
            compiled = lowered.compile()
            seconds[limit].append(time.perf_counter() - start)
            texts[limit] = _without_metadata(compiled.as_text())
    for limit in LIMITS:
        print(f"limit {limit:3d}: compile median {statistics.median(seconds[limit]):.2f} s "
              f"({', '.join(f'{s:.2f}' for s in seconds[limit])})")
    print("optimized HLO equal but for metadata:", texts[LIMITS[0]] == texts[LIMITS[1]])


if __name__ == "__main__":
    main()

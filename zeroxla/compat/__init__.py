"""What differs between the JAX releases zeroxla runs on (jax 0.10 to 0.12), in one place.

Each concern is one small module here that chooses by the installed version (`versions.py`);
no algorithm asks for the version itself (tests/zeroxla/test_package.py checks that nothing
outside this package reads it). Where a newer JAX lifts a limitation, the newer path is used
there and the older one keeps its name.

`BRANCHES` lists every version-dependent branch of the project: where it is, what each side
does, and which CI leg runs each side (.ci/run: leg "0.10" is the default `python3`, 3.11, with
the newest JAX it admits; leg "0.12" is Python 3.12 with the newest jax / flax / optax / orbax
the project's ranges admit).

    versions.py  the installed JAX's (major, minor), read by the modules here alone
    memory.py    a computation in host memory inside a jit (`host_computation`): jax.experimental
                 `compute_on` is a context manager around a `jax.jit` call up to 0.11.0, a function
                 transformation with `out_memory_spaces` from 0.11.1 (a patch release: chosen by
                 `compute_on`'s signature, not the version; `engine.host_update`)
    jaxpr.py     the jaxpr facts the weight split, the cotangent layout and the invariant
                 residuals read: call primitives and their jaxprs, a scan's consts / carries
                 (counted by parameters on 0.10, flat trees from 0.11), re-emitting an equation;
                 and what the step's proof of use reads: dead-code elimination, name stacks
    cache.py     JAX's persistent compilation cache over CPU devices (`check_persistent_cache`):
                 refused before jax 0.12 (an older XLA:CPU runs a read-back program's
                 collectives out of order)
    lowering.py  a jitted function lowered for CUDA on a host with no GPU (`lower_for_cuda`):
                 no branch, one path for both (an abstract H100 that 0.12's Triton lowering
                 requires and 0.10's, falling back to the same compute capability 9.0, ignores)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Branch:
    """One version-dependent choice: `where` (module and function), from which jax version the
    newer side applies (`since`), what the older and the newer side do, and the test of each."""

    where: str
    since: tuple[int, int]
    older: str
    newer: str
    tests: str


BRANCHES: tuple[Branch, ...] = (
    Branch("tests/support/xla_flags.py (CODEGEN_FLAGS)", (0, 12),
           "--xla_cpu_use_fusion_emitters=false speeds the suite's compiles; `fusion_emitters` "
           "tests run in a child pytest with XLA's default emitters",
           "XLA:CPU has only the MLIR fusion emitters (the flag would abort the process); "
           "`fusion_emitters` tests run in-process",
           "every test (both legs start)"),
    # The newer side from jax 0.11.1 (a patch release), read from compute_on's signature.
    Branch("zeroxla/compat/memory.py (host_computation)", (0, 11),
           "`with compute_on('device_host'): jax.jit(fn)(*args)`: the context manager makes the "
           "jit call the host computation, results typed by JAX's rules (host-typed operands "
           "give host-typed results)",
           "`compute_on(fn, compute_type='device_host', out_memory_spaces=Host)`: the function "
           "transformation (0.10's `compute_on2`), every result typed for host memory",
           "tests/zeroxla/compat/test_host_computation.py; engine/test_offload.py, "
           "test_param_offload.py, test_offload_wrappers.py (both legs)"),
    Branch("zeroxla/compat/cache.py (check_persistent_cache)", (0, 12),
           "a step over more than one CPU device is refused while JAX's persistent compilation "
           "cache is on (XLA:CPU runs a read-back program's collectives out of order); the test "
           "suite uses no persistent cache (tests/support/xla_flags.py)",
           "the cache is used like any other program's",
           "tests/zeroxla/compat/test_persistent_cache.py (both legs); tests/test_kept_cache.py's "
           "read-back ZeRO-2 step (leg 2)"),
    Branch("zeroxla/compat/jaxpr.py (scan_params)", (0, 11),
           "a scan equation's `num_consts` and `num_carry` parameters",
           "counted from its `ft_in` (consts, carries, xs) and `ft_out` (carries, ys) flat trees",
           "tests/zeroxla/compat/test_jaxpr_facts.py; pipeline/test_weight_split.py, "
           "test_zero_bubble.py, test_executor.py's ZB-H1 (both legs)"),
)

__all__ = ["BRANCHES", "Branch"]

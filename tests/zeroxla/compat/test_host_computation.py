"""`zeroxla.compat.memory.host_computation` gives the same host computation on every JAX version:
one call carrying XLA's host compute attribute in the lowered program, results typed for host
memory, and values as numpy computes them. Each CI leg runs the side of the branch its JAX
takes (`zeroxla.compat.BRANCHES`)."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.compat.memory import host_computation, is_transformation

HOST = jax.memory.Space.Host


def _update(w, m, g, skip):
    """An SGD-with-momentum step of the kind the host update runs, with a `None` operand."""
    assert skip is None
    m = 0.9 * m + g
    return {"w": w - 0.1 * m, "m": m}


def _step(w, m, g):
    w, m, g = (jax.device_put(x, HOST) for x in (w, m, g))
    out = host_computation(_update)(w, m, g, None)
    spaces = {k: jax.typeof(v).memory_space for k, v in out.items()}
    assert spaces == {"w": HOST, "m": HOST}, spaces          # typed for host memory
    return out


def test_host_computation_is_one_host_call_with_host_typed_results():
    rng = np.random.default_rng(0)
    w, m, g = (rng.standard_normal((4, 6)).astype(np.float32) for _ in range(3))
    text = jax.jit(_step).lower(w, m, g).as_text()
    calls = re.findall(r'= call @\w+\([^)]*\) \{mhlo.frontend_attributes = '
                       r'\{_xla_compute_type = "host"\}\}', text)
    assert len(calls) == 1, text
    out = jax.jit(_step)(w, m, g)
    m_ref = 0.9 * m.astype(np.float64) + g
    np.testing.assert_allclose(out["m"], m_ref, rtol=1e-6)
    np.testing.assert_allclose(out["w"], w - 0.1 * m_ref, rtol=1e-6, atol=1e-7)


def test_the_spelling_is_read_from_compute_ons_signature():
    """jax 0.10 and 0.11.0 define `compute_on(compute_type)` (a context manager); 0.11.1 on
    `compute_on(f=None, *, compute_type, out_memory_spaces, compiler_options=None)` (the
    released wheels' jax/_src/compute_on.py). 0.11.2 took the context-manager side when the
    choice was by (major, minor) and failed on a GPU machine."""
    def context_manager(compute_type: str):              # jax 0.10.2, 0.11.0
        del compute_type

    def transformation(f=None, *, compute_type, out_memory_spaces,   # jax 0.11.1, 0.11.2, 0.12
                       compiler_options=None):
        del f, compute_type, out_memory_spaces, compiler_options

    assert not is_transformation(context_manager)
    assert is_transformation(transformation)
    from jax.experimental.compute_on import compute_on
    assert is_transformation(compute_on) == (jax.__version_info__ >= (0, 11, 1))

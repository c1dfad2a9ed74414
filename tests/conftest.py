"""Every test sees 8 host CPU devices (a 2-node x 4-local mesh is the standard shape), compiled
with the suite's codegen flags (tests/support/xla_flags.py says what they change and what not)."""

import os

import xla_flags  # tests/support, on sys.path through pyproject's `pythonpath`

os.environ["XLA_FLAGS"] = (xla_flags.with_codegen_flags(os.environ.get("XLA_FLAGS", "")) +
                           f" {xla_flags.DEVICE_COUNT_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after the flag)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def devices():
    assert jax.device_count() == 8, "conftest must run before jax initialises its backend"
    return jax.devices()

"""JAX's persistent compilation cache over CPU devices (`zeroxla.compat.cache`): before jax 0.12
a step over more than one CPU device is refused while the cache is on, before anything is
traced or compiled (XLA:CPU there runs a program read back from the cache with its collectives
out of order: tests/support/xla_flags.py has the runs; tests/test_kept_cache.py checks a
read-back step on 0.12); a single device, a cache that is off, and jax 0.12 build as ever."""

import contextlib
import re

import jax
import numpy as np
import pytest

import zeroxla
from zeroxla.compat.cache import check_persistent_cache
from zeroxla.compat.versions import jax_at_least

BEFORE_0_12 = not jax_at_least(0, 12)


@contextlib.contextmanager
def _jax_config(name, value):
    old = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, old)


def _never_built():
    raise AssertionError("the model was built: the refusal must come first")


def test_a_step_over_cpu_devices_refuses_the_cache_before_jax_0_12(tmp_path):
    devices = jax.devices()
    with _jax_config("jax_compilation_cache_dir", str(tmp_path)):
        check_persistent_cache(devices[:1])                 # one device: no collective
        with _jax_config("jax_enable_compilation_cache", False):
            check_persistent_cache(devices)                 # the cache switched off
        if not BEFORE_0_12:
            check_persistent_cache(devices)
            return
        named = re.escape(f"jax_compilation_cache_dir='{tmp_path}'")
        with pytest.raises(ValueError, match=rf"{named}.*out of order.*8 CPU devices.*jax 0\.12"):
            check_persistent_cache(devices)
        with pytest.raises(ValueError, match=r"4 CPU devices"):
            zeroxla.make_step(_never_built, zeroxla.make_mesh(2, 2, devices=devices[:4]))
    assert list(tmp_path.iterdir()) == []                   # nothing compiled into it


@pytest.mark.skipif(not BEFORE_0_12, reason="from jax 0.12 a read-back program runs as compiled")
def test_a_cache_switched_on_after_make_step_is_refused_where_programs_run(tmp_path):
    """make_step checked the cache while it was off; switched on later, the step's init,
    update, `compile` and `eval_loss` (a pipelined step's too), the per-token forward and the
    Hybrid Engine's generation each refuse it before anything of theirs compiles or reads the
    state (None here)."""
    from flax import nnx
    from zeroxla.engine.token_forward import TokenForward
    from zeroxla.models import GPT, GPTConfig

    def gpt():
        return GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0))

    step = zeroxla.make_step(gpt, zeroxla.make_mesh(1, 2, devices=jax.devices()[:2]))
    pipelined = zeroxla.make_step(
        gpt, zeroxla.make_mesh(1, 1, stages=2, devices=jax.devices()[:2]),
        pipeline=zeroxla.PipelineConfig(2))
    forward = TokenForward(step, lambda model, batch: model(batch["tokens"])[..., 0])
    engine = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(max_out_tokens=8))
    batch = {"tokens": np.zeros((2, 4), np.int32)}
    refused = r"jax_compilation_cache_dir=.*out of order.*2 CPU devices"
    with _jax_config("jax_compilation_cache_dir", str(tmp_path)):
        for run in (step.init, lambda: step(None, batch),
                    lambda: step.compile(None, batch), lambda: step.eval_loss(None, batch),
                    lambda: forward(None, batch), pipelined.init,
                    lambda: pipelined(None, batch),
                    lambda: engine.generate(None, [[1, 2]], max_new_tokens=2)):
            with pytest.raises(ValueError, match=refused):
                run()
    assert list(tmp_path.iterdir()) == []                   # nothing compiled into it

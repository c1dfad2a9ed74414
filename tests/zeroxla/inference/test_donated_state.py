"""A state given to the training step is donated: generating from it afterwards is a ValueError
naming the field, never a crash. Before the check, `generate(state_a)`, `step(state_a, batch)`,
`generate(state_a)` killed the process with SIGSEGV (exit 139) once the decode program had been
compiled and the parameters were not pinned, so the sequence runs in a process of its own and
the test reads its exit status."""

import subprocess
import sys

import pytest
import xla_flags

SCRIPT = r"""
import numpy as np, optax
from flax import nnx
import zeroxla
from zeroxla.inference import HybridEngine, HybridEngineConfig
from zeroxla.models import GPT, GPTConfig

step = zeroxla.make_step(GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                         optimizer=optax.sgd(0.1), config=zeroxla.ZeroConfig(stage=3))
pinned = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=2, max_out_tokens=16))
unpinned = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=2, max_out_tokens=16,
                                                 pin_parameters=False))
prompts = [np.arange(3, dtype=np.int32)]
state_a = step.init()
pinned.generate(state_a, prompts, max_new_tokens=2)         # compiled, parameters pinned
unpinned.generate(state_a, prompts, max_new_tokens=2)       # compiled
tokens = np.random.default_rng(0).integers(0, 65, (8, 9)).astype(np.int32)
state_b, _ = step(state_a, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
try:
    pinned.generate(state_a, prompts, max_new_tokens=2)
except ValueError as err:
    print("pinned:", err, flush=True)
print("state_b:", pinned.generate(state_b, prompts, max_new_tokens=2)[0].size, flush=True)
unpinned.generate(state_a, prompts, max_new_tokens=2)       # the segfault, before the check
"""

MESSAGE = ("is deleted: the state was donated to the training step (`state, metrics = "
           "step(state, batch)` consumes the state it is given); use the state the step "
           "returned")


@pytest.mark.slow   # a process of its own (a crash must not take the worker down)
def test_generate_from_a_donated_state_is_a_value_error_not_a_crash(tmp_path):
    env = xla_flags.child_environ()
    env["XLA_FLAGS"] += f" {xla_flags.DEVICE_COUNT_FLAG}=8"
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert "pinned: state.params[" in result.stdout and MESSAGE in result.stdout
    assert "state_b: 5" in result.stdout                # the state the step returned still works
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: state.params[") and last.endswith(MESSAGE)

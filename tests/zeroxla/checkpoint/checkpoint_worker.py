"""The run that test_checkpoint.py checkpoints, and the fresh processes it restores in.

    python checkpoint_worker.py resume DIR OUT.json    restore DIR's newest checkpoint, train to
                                                      STEPS, write the losses and metadata
    python checkpoint_worker.py killed-save DIR MARKER save the initial state as step 0, then
                                                      start saving step 1 and hang once its array
                                                      writes have started (MARKER appears); the
                                                      test SIGKILLs this process there

Imported by the test for the shared setup (`make_run`, `BATCHES`), so both processes build the
identical step.
"""

import os
import sys

if __name__ == "__main__":
    # The same XLA setup as tests/conftest.py, before JAX starts its backend.
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # tests/support holds reference.py (pytest puts it on sys.path through pyproject's
    # `pythonpath`).
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "support"))

import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

from zeroxla import models  # noqa: E402
from reference import token_batches  # noqa: E402
from zeroxla import checkpoint  # noqa: E402
from zeroxla.sharding.config import ZeroConfig  # noqa: E402
from zeroxla.sharding.mesh import make_mesh  # noqa: E402
from zeroxla.make import make_step  # noqa: E402

STEPS, SAVE_AT = 10, 5
BATCH, SEQ = 8, 16
BATCHES = token_batches(STEPS, BATCH, SEQ, vocab=65, seed=0)
# ZeRO-3 with hpZ over the 4 local devices; biases and norms stay replicated (threshold 500).
CONFIG = ZeroConfig(stage=3, persistence_threshold=500, hpz_partition_size=4,
                    gradient_clipping=1.0)


def optimizer():
    return optax.adamw(3e-3, weight_decay=0.1)


def make_run(mesh=None, config=CONFIG):
    """The checkpointed run's step (2 x 4 mesh unless `mesh` is given)."""
    mesh = make_mesh(2, 4) if mesh is None else mesh
    return make_step(lambda: models.build("gpt-tiny", seed=1), mesh, optimizer=optimizer(),
                     config=config)


def train(step, state, batches):
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def resume(directory, out):
    step = make_run()
    restored = checkpoint.restore(directory, step)
    start = int(restored.state.step)
    _, losses = train(step, restored.state, BATCHES[start:])
    rng = restored.metadata["rng"]
    Path(out).write_text(json.dumps({
        "start": start, "losses": losses,
        "data_position": restored.metadata["data_position"],
        "rng": jax.random.key_data(rng).tolist()}))


def killed_save(directory, marker):
    import orbax.checkpoint as ocp

    step = make_run()
    state = step.init()
    checkpoint.save(directory, state, layout=step.layout)
    original = ocp.type_handlers.ArrayHandler.serialize

    async def serialize_then_hang(self, *args, **kwargs):
        futures = await original(self, *args, **kwargs)
        Path(marker).write_text("array writes started\n")
        while True:               # the test kills us here, mid-save
            time.sleep(1)
        return futures

    ocp.type_handlers.ArrayHandler.serialize = serialize_then_hang
    checkpoint.save(directory, state.replace(step=state.step + 1), layout=step.layout)
    raise AssertionError("the second save should have hung")


if __name__ == "__main__":
    jax.config.update("jax_default_matmul_precision", "highest")   # as tests/conftest.py
    command, *rest = sys.argv[1:]
    {"resume": resume, "killed-save": killed_save}[command](*rest)

"""One process of a real multi-process ZeRO-3 run (gloo CPU collectives on 127.0.0.1).

    python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.json

Each process owns 4 CPU devices (one "node" of the 2 x 4 mesh), builds only its own devices'
rows of every batch, and trains the tiny GPT for a few steps. Process 0 writes the losses.
"""

import json
import os
import sys

import jax

STEPS = 3


def main(process_id: int, num_processes: int, port: int, out: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=num_processes, process_id=process_id)
    losses, shard_rows = train(jax.devices())
    if process_id == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "local_devices": jax.local_device_count(),
                       "global_devices": jax.device_count(), "rows": shard_rows}, f)
    jax.distributed.shutdown()


def train(devices):
    """The run both sides compare: ZeRO-3 on a 2 x 4 mesh over `devices`, 3 steps."""
    import optax

    from zeroxla import models
    import zeroxla
    from zeroxla.app.data import BatchPlan, device_batch, load_corpus

    corpus = load_corpus()
    mesh = zeroxla.make_mesh(2, 4, devices=devices)
    step = zeroxla.make_step(lambda: models.build("gpt-tiny"), mesh, optimizer=optax.adamw(3e-3),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=500))
    state = step.init()
    plan = BatchPlan(len(corpus.train), 16, 32, seed=0)
    losses = []
    for k in range(STEPS):
        batch = device_batch(corpus.train, plan, k, step.layout.batch_sharding)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    rows = sorted(shard.data.shape[0] for shard in batch["inputs"].addressable_shards)
    return losses, rows


if __name__ == "__main__":
    # Before the backend starts (XLA reads the flag then): this process's 4 devices, and the
    # test's other XLA flags (tests/support/xla_flags.py), as `zeroxla launch` would set them.
    from zeroxla.app.launch import with_device_count

    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), 4)
    os.environ["JAX_PLATFORMS"] = "cpu"
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

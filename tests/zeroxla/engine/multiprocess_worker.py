"""One process of a real multi-process ZeRO-3 run (gloo CPU collectives on 127.0.0.1).

    python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.json [moe-ep]

Each process owns 4 CPU devices (one "node" of the 2 x 4 mesh), builds only its own devices'
rows of every batch, and trains the tiny GPT for a few steps. Process 0 writes the losses.
`moe-ep`: an MoE model instead, its 8 experts split over an expert axis of all 8 devices
(both processes), its router zero so that every token goes to experts 0 and 1 (device 0's)
and seven devices' experts get none; every process writes its losses and the collectives of
its own compiled program (OUT.json with the process id appended).
"""

import json
import os
import sys

import jax

STEPS = 3


def main(process_id: int, num_processes: int, port: int, out: str, mode: str = "") -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=num_processes, process_id=process_id)
    if mode == "moe-ep":
        losses, found = train_moe_ep(jax.devices())
        with open(f"{out}.{process_id}", "w") as f:
            json.dump({"losses": losses, "collectives": found}, f)
        jax.distributed.shutdown()
        return
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


def train_moe_ep(devices):
    """An MoE model (test_moe_training's) with a zero router, EP = 8 x ZeRO-3 over `devices`,
    3 SGD steps: (losses, [(kind, group size, operand bytes, runs)] of the compiled step)."""
    import numpy as np
    import optax

    import zeroxla
    from zeroxla.analysis.hlo import collectives
    from test_moe_training import zero_router_model

    mesh = zeroxla.make_mesh(1, 1, expert=8, devices=devices)
    step = zeroxla.make_step(zero_router_model, mesh, optimizer=optax.sgd(0.1),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    state, losses = step.init(), []
    for k in range(STEPS):
        tokens = np.random.default_rng(k).integers(0, 64, (16, 17)).astype(np.int32)
        batch = {name: jax.make_array_from_callback(
            (16, 16), step.layout.batch_sharding, lambda index, a=array: a[index])
            for name, array in (("inputs", tokens[:, :-1]), ("targets", tokens[:, 1:]))}
        if k == 0:
            found = [(c.kind, c.group_size, c.operand_bytes, c.multiplier)
                     for c in collectives(step.compile(state, batch))]
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, found


if __name__ == "__main__":
    # Before the backend starts (XLA reads the flag then): this process's 4 devices, and the
    # test's other XLA flags (tests/support/xla_flags.py), as `zeroxla launch` would set them.
    from zeroxla.app.launch import set_host_threads, with_device_count

    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), 4)
    set_host_threads(os.environ, 4)
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "support"))
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:])

"""ZeRO stages 0-3 against GSPMD auto-sharding, on 8 simulated CPU devices (2 nodes x 4).

    python benchmarks/zero.py [--models gpt-tiny gpt-small] [--steps 10]

For each model: median step time and per-device memory (training state, and XLA's peak for the
compiled step) of zeroxla stages 0-3 and of the same model sharded by GSPMD the way MaxText does
FSDP: every parameter and optimizer leaf annotated with a NamedSharding over the largest dim that
divides the device count, XLA inserting the collectives. Ratios are against GSPMD, measured in the
same run, plus the traffic read from each compiled step: payload bytes of all-gathers,
reduce-scatters and all-reduces per float32 parameter byte (ZeRO-3: ~2 / ~1 / small; stage 0:
0 / 0 / 1). CPU step times say little about a GPU cluster (collectives are memcpys here); memory
and traffic numbers are exact.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from zeroxla import models  # noqa: E402
import zeroxla  # noqa: E402
from zeroxla.engine.mesh import DATA_AXES  # noqa: E402

SEQ = {"gpt-tiny": 64, "gpt-small": 128, "llama-tiny": 64, "llama-small": 128}


def _batch(model_name: str, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 65, (batch_size, SEQ[model_name] + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _time(run, steps: int) -> float:
    run()                                       # compile + first step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _state_bytes(tree) -> int:
    per_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes)


def bench_zero(model_name: str, stage: int, mesh, batch, steps: int) -> dict:
    step = zeroxla.make_step(lambda: models.build(model_name), mesh,
                             optimizer=optax.adamw(1e-3),
                             config=zeroxla.ZeroConfig(stage=stage, persistence_threshold=1000))
    holder = {"state": step.init()}
    compiled = step.compile(holder["state"], batch)
    report = zeroxla.comm_report(step, holder["state"], batch)
    param_bytes = sum(4 * leaf.layers * leaf.padded_numel for leaf in step.plan.leaves)

    def run():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"]
    seconds = _time(run, steps)
    return {"seconds": seconds, "state": _state_bytes(holder["state"]), "peak": _peak(compiled),
            "gathered": report.all_gather_bytes() / param_bytes,
            "scattered": report.reduce_scatter_bytes() / param_bytes,
            "all_reduced": report.all_reduce_bytes() / param_bytes}


def _fsdp_spec(shape: tuple[int, ...], devices: int) -> P:
    """GSPMD FSDP: shard the largest dim that divides the device count, else replicate."""
    dims = sorted(range(len(shape)), key=lambda d: -shape[d])
    for d in dims:
        if shape[d] % devices == 0 and shape[d] >= devices:
            spec = [None] * len(shape)
            spec[d] = DATA_AXES
            return P(*spec)
    return P()


def bench_gspmd(model_name: str, mesh, batch, steps: int) -> dict:
    model = models.build(model_name)
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = optax.adamw(1e-3)
    n = mesh.devices.size
    param_sh = jax.tree.map(lambda x: NamedSharding(mesh, _fsdp_spec(x.shape, n)), params)
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_state, param_sh,
                                   transform_non_params=lambda _: NamedSharding(mesh, P()))
    batch_sh = NamedSharding(mesh, P(DATA_AXES))

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            return zeroxla.next_token_loss(nnx.merge(graphdef, p), batch)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(train_step, in_shardings=(param_sh, opt_sh, batch_sh),
                     out_shardings=(param_sh, opt_sh, NamedSharding(mesh, P())),
                     donate_argnums=(0, 1))
    params = jax.device_put(params, param_sh)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
    batch = jax.device_put(batch, batch_sh)
    compiled = jitted.lower(params, opt_state, batch).compile()
    holder = {"params": params, "opt": opt_state}

    def run():
        holder["params"], holder["opt"], loss = jitted(holder["params"], holder["opt"], batch)
        return loss
    seconds = _time(run, steps)
    return {"seconds": seconds, "state": _state_bytes((holder["params"], holder["opt"])),
            "peak": _peak(compiled)}


def _traffic(row: dict) -> str:
    """Payload bytes of all-gathers / reduce-scatters / all-reduces per parameter byte."""
    if "gathered" not in row:
        return "(XLA's choice)"
    return f"{row['gathered']:.2f}/{row['scattered']:.2f}/{row['all_reduced']:.2f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt-tiny", "gpt-small"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    mesh = zeroxla.make_mesh(2, 4)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"mesh 2x4, batch {args.batch_size}, median of {args.steps} steps")
    header = f"{'model':<11}{'run':<8}{'step ms':>9}{'x GSPMD':>9}{'state MiB':>11}{'x GSPMD':>9}" \
             f"{'peak MiB':>10}{'x GSPMD':>9}  {'AG/RS/AR x params':>18}"
    print(header)
    print("-" * len(header))
    for name in args.models:
        batch = _batch(name, args.batch_size)
        base = bench_gspmd(name, mesh, batch, args.steps)
        rows = [("gspmd", base)] + [(f"zero-{s}", bench_zero(name, s, mesh, batch, args.steps))
                                    for s in range(4)]
        for label, r in rows:
            print(f"{name:<11}{label:<8}{1e3 * r['seconds']:>9.1f}"
                  f"{r['seconds'] / base['seconds']:>9.2f}{r['state'] / 2**20:>11.3f}"
                  f"{r['state'] / base['state']:>9.2f}{r['peak'] / 2**20:>10.2f}"
                  f"{r['peak'] / base['peak']:>9.2f}  {_traffic(r):>18}")


if __name__ == "__main__":
    main()

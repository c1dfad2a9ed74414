"""ZeRO stages 0-3 against the two baselines a JAX user would run, on 8 simulated CPU devices.

    python benchmarks/zero.py [--models gpt-small] [--steps 5] [--batch-size 32]

Runs, all on one 2-node x 4-local mesh, the same model, batch and AdamW, measured in one process:

* `dp`: plain data parallelism. `jax.jit` with every parameter and optimizer leaf replicated and
  the batch split over the data axes; XLA inserts the gradient all-reduce.
* `fsdp`: GSPMD FSDP the way MaxText runs it. Logical-axis rules put `embed` (and the batch) on
  the data axes and leave every other logical axis whole, parameters and optimizer state get
  those NamedShardings, the activations are constrained to the batch sharding at every layer
  boundary (MaxText's `activation_batch` constraints), and XLA inserts the collectives. A leaf
  with no `embed` dim (biases, norms) or one the data size does not divide stays replicated.
* `zero-0` ... `zero-3`: zeroxla's step (`make_step`), persistence threshold 1000.

For each: the median step time, the per-device training state, XLA's peak for the compiled step
(`compiled.memory_analysis()`: arguments + temporaries + outputs - donated), and the bytes each
device sends per step, read from the compiled program (`compiled.as_text()` parsed by
`zeroxla.analysis`; `comm_report`'s convention: a collective over g devices with payload S sends
S (g-1)/g per device, an all-reduce twice that). Ratios are against `dp` and `fsdp` of the same
run. `AG/RS/AR/A2A` is the payload of all-gathers / reduce-scatters / all-reduces / all-to-alls
per float32 parameter byte. CPU step times say little about a GPU cluster (collectives are
memory copies and the two cores are shared); memory and bytes are properties of the programs.
"""

from __future__ import annotations

import argparse
import math
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

import zeroxla  # noqa: E402
from zeroxla import models  # noqa: E402
from zeroxla.analysis.comm_report import comm_report  # noqa: E402
from zeroxla.engine.loss import token_cross_entropy  # noqa: E402
from zeroxla.sharding.mesh import DATA_AXES  # noqa: E402
from zeroxla.models import axes  # noqa: E402
from zeroxla.models.layers import call_block, default_positions  # noqa: E402

SEQ = {"gpt-tiny": 64, "gpt-small": 128, "llama-tiny": 64, "llama-small": 128}
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
# MaxText-style logical-axis rules for pure FSDP: the batch and `embed` on the data axes ("fsdp"
# in MaxText), every other logical axis unsharded. The first matching rule wins.
FSDP_RULES = ((axes.BATCH, DATA_AXES), (axes.EMBED, DATA_AXES))


def _batch(model_name: str, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 65, (batch_size, SEQ[model_name] + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _time(run, steps: int) -> float:
    jax.block_until_ready(run())                # compile + first step
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


def _measure(compiled, mesh, run, state_of, steps: int) -> dict:
    """Time `run`, then read peak and traffic from `compiled`."""
    report = comm_report(compiled, mesh=mesh)
    seconds = _time(run, steps)
    return {"seconds": seconds, "state": _state_bytes(state_of()), "peak": _peak(compiled),
            "sent": report.total_bytes,
            "payload": {kind: report.payload_bytes(kind) for kind in KINDS}}


# ------------------------------------------------------------------------------------------------
# zeroxla

def bench_zero(model_name: str, stage: int, mesh, batch, steps: int) -> dict:
    step = zeroxla.make_step(lambda: models.build(model_name), mesh,
                             optimizer=optax.adamw(1e-3),
                             config=zeroxla.ZeroConfig(stage=stage, persistence_threshold=1000))
    holder = {"state": step.init()}
    compiled = step.compile(holder["state"], batch)

    def run():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"]
    return _measure(compiled, mesh, run, lambda: holder["state"], steps)


# ------------------------------------------------------------------------------------------------
# The baselines: one jitted train step, shardings given, XLA inserting the collectives.

def _fsdp_spec(logical: tuple[str | None, ...], shape: tuple[int, ...], devices: int) -> P:
    """The logical-axis rules applied to one parameter: the first dim whose name has a rule,
    if the data size divides it; else replicated (MaxText would refuse such a leaf)."""
    for d, name in enumerate(logical):
        for rule_name, mesh_axes in FSDP_RULES:
            if name == rule_name and shape[d] % devices == 0:
                spec: list = [None] * len(shape)
                spec[d] = mesh_axes
                return P(*spec)
    return P()


def _constrained_forward(model, tokens: jax.Array, batch_sharding: NamedSharding) -> jax.Array:
    """The model's forward (embed -> stacked blocks -> head, as `GPT.__call__` / `Llama`) with
    the activations constrained to the batch sharding at every layer boundary, as MaxText's
    decoder does; GSPMD is then free to choose only how to move the weights."""
    def constrain(x):
        return jax.lax.with_sharding_constraint(x, batch_sharding)
    positions = default_positions(tokens)
    x = constrain(model.embed(tokens, positions))                          # [B, T, D]
    graphdef, layers = nnx.split(model.blocks.layers)

    def body(h, layer_state):
        h, _ = call_block(nnx.merge(graphdef, layer_state), h, (positions,), None)
        return constrain(h), None
    x, _ = jax.lax.scan(body, x, layers)
    return model.head(x)                                                   # [B, T, V]


def bench_jit(model_name: str, mode: str, mesh, batch, steps: int) -> dict:
    """`mode` "dp": parameters replicated; "fsdp": the MaxText rules above."""
    model = models.build(model_name)
    if not all(hasattr(model, a) for a in ("embed", "blocks", "head")):
        raise ValueError(f"model {model_name!r} has no embed/blocks/head; the GSPMD baselines "
                         "replay that forward with activation constraints")
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = optax.adamw(1e-3)
    n = mesh.devices.size
    batch_sh = NamedSharding(mesh, P(DATA_AXES))

    def sharding(v: nnx.Variable) -> nnx.Variable:
        logical = tuple(v.get_metadata()["logical_axes"])
        spec = _fsdp_spec(logical, v.shape, n) if mode == "fsdp" else P()
        return v.replace(NamedSharding(mesh, spec))
    param_sh = jax.tree.map(sharding, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_state, param_sh,
                                   transform_non_params=lambda _: NamedSharding(mesh, P()))

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            module = nnx.merge(graphdef, p)
            if mode == "fsdp":
                logits = _constrained_forward(module, batch["inputs"], batch_sh)
            else:
                logits = module(batch["inputs"])
            total, count = token_cross_entropy(logits, batch)     # zeroxla's default loss
            return total / count
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
        holder["params"], holder["opt"], loss = compiled(holder["params"], holder["opt"], batch)
        return loss
    return _measure(compiled, mesh, run, lambda: (holder["params"], holder["opt"]), steps)


# ------------------------------------------------------------------------------------------------
# The table.

def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base else "-"


def _traffic(row: dict, param_bytes: int) -> str:
    return "/".join(f"{row['payload'][k] / param_bytes:.2f}" for k in KINDS)


def table(model_name: str, rows: list[tuple[str, dict]], param_bytes: int) -> list[str]:
    dp, fsdp = dict(rows)["dp"], dict(rows)["fsdp"]
    lines = []
    for label, r in rows:
        lines.append(
            f"{model_name:<10}{label:<8}{1e3 * r['seconds']:>9.1f}"
            f"{_ratio(r['seconds'], dp['seconds']):>6}{_ratio(r['seconds'], fsdp['seconds']):>7}"
            f"{r['state'] / 2**20:>10.2f}{r['peak'] / 2**20:>10.2f}"
            f"{_ratio(r['peak'], dp['peak']):>6}{_ratio(r['peak'], fsdp['peak']):>7}"
            f"{r['sent'] / 2**20:>10.2f}{_ratio(r['sent'], dp['sent']):>6}"
            f"{_ratio(r['sent'], fsdp['sent']):>7}  {_traffic(r, param_bytes)}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt-small"], choices=sorted(SEQ))
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    mesh = zeroxla.make_mesh(2, 4)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"mesh 2x4, batch {args.batch_size}, AdamW float32, median of {args.steps} steps")
    header = (f"{'model':<10}{'run':<8}{'step ms':>9}{'xDP':>6}{'xFSDP':>7}{'state MiB':>10}"
              f"{'peak MiB':>10}{'xDP':>6}{'xFSDP':>7}{'sent MiB':>10}{'xDP':>6}{'xFSDP':>7}"
              f"  AG/RS/AR/A2A x params")
    print(header)
    print("-" * len(header))
    for name in args.models:
        batch = _batch(name, args.batch_size)
        param_bytes = 4 * sum(math.prod(x.shape) for x in jax.tree.leaves(
            nnx.state(models.build(name), nnx.Param)))
        rows = [("dp", bench_jit(name, "dp", mesh, batch, args.steps)),
                ("fsdp", bench_jit(name, "fsdp", mesh, batch, args.steps))]
        rows += [(f"zero-{s}", bench_zero(name, s, mesh, batch, args.steps)) for s in range(4)]
        print("\n".join(table(name, rows, param_bytes)), flush=True)


if __name__ == "__main__":
    main()

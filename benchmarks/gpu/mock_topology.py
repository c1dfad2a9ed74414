"""The 8-GPU ZeRO-3 step compiled on one GPU for a mock topology, and its schedule read.

    python benchmarks/gpu/mock_topology.py [--layers 4] [--seq 4096] [--tiny]

jax's GPU client can pretend to be part of a larger machine (`jax_mock_gpu_topology`
"<slices>x<hosts per slice>x<devices per host>", or `mock_num_gpu_processes`: mock NCCL, the
other processes' devices present but not addressable): programs are partitioned and compiled
for all of them by XLA:GPU, as a real 8-GPU run compiles them. Each setting is tried in its
own process (the client is made once per process) until one gives 8 devices.

The program: Llama-3.1-8B's layer dims (`--layers` layers, vocabulary 128,256), bf16 compute,
AdamW, ZeRO-3 over `make_mesh(2, 4)` (2 nodes x 4 local), 8 sequences of `--seq` tokens,
compiled from abstract state and batch (`zeroxla.analysis.abstract_step`). Read from its
scheduled HLO (`zeroxla.analysis.schedule`): per collective kind, the asynchronous pairs, those
with a matrix multiplication between start and done (the transfer hidden behind compute), those
with nothing between, and the synchronous ones; the per-device memory XLA plans.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

SECTION = "mock_topology"
# (how, value): "options" passes the PJRT client options the mock flags would set
# (`jax_pjrt_client_create_options`, which reaches every plugin whatever its name); "env" sets
# the flag itself.
SETTINGS = (("options", "1x8x1"), ("options", "1x2x4"), ("nodes", "8"),
            ("env", "JAX_MOCK_GPU_TOPOLOGY=1x8x1"), ("env", "MOCK_NUM_GPU_PROCESSES=8"))


def apply(how: str, value: str) -> None:
    """Before the backend starts: the mock, as client options or as the environment says."""
    import jax

    if how == "nodes":          # mock NCCL over N processes, no topology string
        jax.config.update("jax_pjrt_client_create_options",
                          {"enable_mock_nccl": True, "num_nodes": int(value)})
    if how == "options":
        slices, hosts, _ = (int(x) for x in value.split("x"))
        jax.config.update("jax_pjrt_client_create_options", {
            "enable_mock_nccl": True, "num_nodes": slices * hosts, "mock_gpu_topology": value})


def child(args) -> int:
    import jax
    import optax
    from flax import nnx

    import faulthandler
    faulthandler.enable()       # a crash in the client's creation names where it happened
    how, value = args.setting.split(":", 1)
    apply(how, value)
    import common
    import zeroxla
    from zeroxla import models
    from zeroxla.analysis.abstract_step import compile_abstract
    from zeroxla.analysis.schedule import async_pairs, summary, sync_collectives
    from zeroxla.models import presets

    devices = jax.devices()
    from jax._src import xla_bridge

    facts = dict(setting=args.setting, devices=len(devices), processes=jax.process_count(),
                 local_devices=jax.local_device_count(), backend=jax.default_backend(),
                 plugins=sorted(xla_bridge.backends()))
    print(facts, flush=True)
    if len(devices) != 8:
        common.record(SECTION, **facts, error="not 8 devices")
        return 3
    config = presets.config("Llama-3.1-8B").replace(num_layers=args.layers,
                                                   max_seq_len=args.seq)
    if args.tiny:
        config = config.replace(vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2,
                                mlp_dim=128)
    step = zeroxla.make_step(lambda: models.Llama(config, rngs=nnx.Rngs(0)),
                             zeroxla.make_mesh(2, 4, devices=devices),
                             optimizer=optax.adamw(1e-4),
                             config=zeroxla.ZeroConfig(stage=3, compute_dtype="bfloat16"))
    compiled = compile_abstract(step, sequences=8, seq_len=args.seq)
    text = compiled.as_text()
    (common.out_dir() / "mock_topology_hlo.txt").write_text(text)
    pairs = async_pairs(text)
    common.record(SECTION, **facts, layers=args.layers, seq=args.seq,
                  is_scheduled="is_scheduled=true" in text[:2000],
                  collectives=summary(pairs, sync_collectives(text)),
                  **common.compiled_bytes(compiled))
    for pair in pairs:
        print(f"  {pair.kind:16} {pair.computation[:40]:40} {pair.start[:30]:30} -> "
              f"{pair.done}: {pair.compute_between} compute, {pair.matmuls_between} matmuls")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--tiny", action="store_true", help="a CPU check of the script")
    parser.add_argument("--setting", help="(internal) HOW:VALUE of the mock tried here")
    parser.add_argument("--timeout-each", type=float, default=240.0)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.seq = 2, 128
    if args.setting:
        sys.exit(child(args))
    settings = SETTINGS
    if args.tiny:       # no GPU client to mock: 8 host devices stand in for the check
        settings = (("env", "XLA_FLAGS=--xla_force_host_platform_device_count=8"),)
    for how, value in settings:
        env = dict(os.environ)
        if how == "env":
            name, _, setting = value.partition("=")
            env[name] = setting
        command = [sys.executable, __file__, "--setting", f"{how}:{value}", "--layers",
                   str(args.layers), "--seq", str(args.seq)] + (["--tiny"] if args.tiny else [])
        print(f"=== {SECTION}: {how} {value}", flush=True)
        try:
            code = subprocess.run(command, env=env, timeout=args.timeout_each).returncode
            print(f"{how} {value}: exit {code}", flush=True)
            if code == 0:
                return
        except subprocess.TimeoutExpired:
            print(f"{name}={value}: timed out after {args.timeout_each} s", flush=True)


if __name__ == "__main__":
    main()

"""The training step on one device: zeroxla stages 0 and 3 against a plain `jax.jit` step of the
same model and optax optimizer, each in its own process (peak memory per variant).

    python benchmarks/gpu/train_step.py --variants plain zero0 zero3 [--dtype bf16] \
        [--seq 1024] [--batch 16] [--timeout-each 120] [--tiny]
    python benchmarks/gpu/train_step.py --model Llama-3.1-8B --layers 8 --seq 8192 --batch 1 \
        --variants plain zero3

Model: GPT-2 124M (`models.GPTConfig.gpt2_124m`: 12 layers, d 768, 12 heads, vocab 50257;
max_seq_len raised to --seq when longer), or with `--model` a preset of `models.presets` (its
published config.json's shape) cut to `--layers` layers, `attention="auto"` (cuDNN's fused attention on a CUDA
GPU where it applies, else blockwise), seed 0 in every variant (zeroxla builds it from a factory
inside its init, the plain step eagerly: the same values). Optimizer `optax.adamw(3e-4)`,
float32 master weights and Adam state, compute in --dtype (bf16 or fp16).

* `plain`: what a user writes: `nnx.split`, the float parameters cast to the compute dtype for
  the forward, `jax.value_and_grad` of the mean next-token loss through the model's own chunked
  log-probs (`model.token_logprobs`, the loss zeroxla's default computes), optax update, one
  `jax.jit` with parameters and optimizer state donated. fp16: a static loss scale of 1024,
  the update skipped when a gradient is not finite (zeroxla's `loss_scale=1024` does the same).
* `plain_logits`: as `plain`, the loss from the whole float32 logits (`model(inputs)`,
  log-softmax): the [B, T, V] tensor a user's first loss builds.
* `zero0` / `zero3`: `zeroxla.make_step(model, make_mesh(1, 1), optimizer=...,
  config=ZeroConfig(stage=0|3, compute_dtype=..., loss_scale=1024 under fp16))`.
* `zero3_offload`: stage 3 with ZeRO-Offload (`offload_optimizer="cpu"`, pinned): master
  weights and Adam state in the GPU's pinned host memory, the update on the host
  (`compute_on("device_host")`); `zero3_infinity`: that and `offload_param="cpu"`.
* `zero3_no_prefetch` (`prefetch=False`), `zero3_persistent` (every leaf persistent): where
  stage 3's overhead on one device comes from.

Data: 4 fixed batches of random tokens, targets = inputs + 1 (mod V), on the device before the
first step; step i takes batch i mod 4. `--packed`: every row packs sequences of 64..T/4 tokens
(segment ids, positions restarting per sequence) and ends in 64 padding tokens out of the loss
(`loss_mask`), in the plain step's loss as in zeroxla's: cuDNN's route takes no segment ids, so
"auto" attention is the Pallas flash kernel on a CUDA GPU (16-bit), blockwise elsewhere. Reported per variant: the losses of steps 1..5, the
first step's seconds (compile included), tokens/s from the median of --steps timed steps after
2 warm-ups, MFU = (6 N + 12 L d T) x tokens/s / peak, with N the parameters less the position
table (nanoGPT's `estimate_mfu`), L layers, d model width, T sequence length, peak 989e12 (H100
SXM dense bf16/fp16, --peak-flops), the device's peak bytes in use, XLA's compiled temporaries,
and for zeroxla the program markers of the per-platform branches (`program_markers.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import common

SECTION = "train_step"
VARIANTS = ("plain", "plain_logits", "zero0", "zero3", "zero3_offload", "zero3_infinity",
            "zero3_no_prefetch", "zero3_persistent")
ZERO_VARIANTS = {
    "zero0": dict(stage=0), "zero3": dict(stage=3),
    "zero3_offload": dict(stage=3, offload_optimizer="cpu", offload_pin_memory=True),
    "zero3_infinity": dict(stage=3, offload_optimizer="cpu", offload_param="cpu",
                           offload_pin_memory=True),
    # Where stage 3's one-device overhead comes from: without the next layer's prefetch, and
    # with every leaf persistent (nothing gathered per layer).
    "zero3_no_prefetch": dict(stage=3, prefetch=False),
    "zero3_persistent": dict(stage=3, persistence_threshold=2**40),
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
FP16_LOSS_SCALE = 1024.0
WARMUP, FIRST_LOSSES, BATCHES = 2, 5, 4


def model_config(seq: int, tiny: bool, attention: str, model: str = "gpt2-124m",
                 layers: int | None = None):
    """GPT-2 124M, or a preset of `models.presets` (e.g. Llama-3.1-8B) with `layers` of its
    layers; `tiny`: a small model of the same family (a CPU check of the script)."""
    from zeroxla import models
    from zeroxla.models import presets

    if model == "gpt2-124m":
        base = models.GPTConfig.tiny() if tiny else models.GPTConfig.gpt2_124m()
    else:
        base = presets.config(model)
        if tiny:
            base = base.replace(vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2,
                                mlp_dim=128)
    if layers:
        base = base.replace(num_layers=layers)
    return base.replace(max_seq_len=max(seq, 128 if tiny else base.max_seq_len),
                        attention=attention)


def flops_per_token(config, seq: int) -> tuple[float, int]:
    """(6 N + 12 L d T, N) with N the parameters that multiply: less GPT-2's position table and
    an untied model's input embedding (lookups; a tied table is the output head and counts)."""
    import jax
    from flax import nnx

    from zeroxla import models

    params = nnx.state(models.abstract_model(config), nnx.Param)
    n = sum(x.size for x in jax.tree.leaves(params))
    if config.family == "gpt":
        n -= config.max_seq_len * config.d_model
    elif not getattr(config, "tie_word_embeddings", True):
        n -= config.vocab_size * config.d_model
    return 6.0 * n + 12.0 * config.num_layers * config.d_model * seq, n


def batches(batch: int, seq: int, vocab: int, packed: bool = False):
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for _ in range(BATCHES):
        inputs = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
        arrays = {"inputs": inputs, "targets": (inputs + 1) % vocab}
        if packed:
            arrays.update(common.packed_rows(rng, batch, seq))
        out.append(jax.device_put(arrays))
    return out


def plain_step(model, optimizer, dtype, whole_logits: bool):
    """(step(params, opt_state, batch) -> (params, opt_state, loss), params, opt_state)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    scale = FP16_LOSS_SCALE if dtype == jnp.float16 else 1.0

    def loss_fn(p, batch):
        compute = jax.tree.map(
            lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, p)
        m = nnx.merge(graphdef, compute, rest)
        packing = {k: batch[k] for k in ("positions", "segment_ids") if k in batch}
        if whole_logits:
            logits = m(batch["inputs"], **packing).astype(jnp.float32)
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1),
                                       batch["targets"][..., None], axis=-1)[..., 0]
        else:
            logp = m.token_logprobs(batch["inputs"], batch["targets"], **packing)
        mask = batch.get("loss_mask", jnp.ones_like(logp))
        return -jnp.sum(logp * mask) / jnp.sum(mask) * scale

    def step(p, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
        updates, new_state = optimizer.update(grads, opt_state, p)
        new_p = optax.apply_updates(p, updates)
        if scale != 1.0:                   # fp16: skip the update on a non-finite gradient
            finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g))
                                        for g in jax.tree.leaves(grads)]))
            new_p, new_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b),
                                            (new_p, new_state), (p, opt_state))
        return new_p, new_state, loss / scale

    return jax.jit(step, donate_argnums=(0, 1)), params, optimizer.init(params)


def run_variant(args) -> dict:
    """Builds, runs and measures one variant in this process."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import zeroxla
    from zeroxla import models
    from zeroxla.models import attention as attention_dispatch

    dtype_name = DTYPES[args.dtype]
    dtype = jnp.dtype(dtype_name)
    config = model_config(args.seq, args.tiny, args.attention, args.model, args.layers)
    per_token, n_params = flops_per_token(config, args.seq)
    head_dim = config.d_model // config.num_heads
    q = jax.ShapeDtypeStruct((args.batch, args.seq, config.num_heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((args.batch, args.seq, getattr(config, "num_kv_heads",
                                                             config.num_heads), head_dim), dtype)
    segments = jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32) if args.packed else None
    route = attention_dispatch.choose(q, kv, kv, segment_ids=segments,
                                      implementation=args.attention)
    model_class = models.model_class(config)

    def build_model():
        """The model; with --logits-chunk, its chunked head's chunk set (`logits_chunk`, a
        static attribute of the module owning the head)."""
        model = model_class(config, rngs=nnx.Rngs(0))
        if args.logits_chunk:
            for _, module in nnx.iter_modules(model):
                if hasattr(module, "logits_chunk"):
                    module.logits_chunk = args.logits_chunk
        return model
    data = batches(args.batch, args.seq, config.vocab_size, args.packed)
    optimizer = optax.adamw(3e-4)
    losses, times, markers, compiled = [], [], None, None

    if args.variant.startswith("plain"):
        step, params, opt_state = plain_step(build_model(), optimizer,
                                             dtype, args.variant == "plain_logits")
        lowered = step.lower(params, opt_state, data[0])
        start = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start

        def one(i):
            nonlocal params, opt_state
            params, opt_state, loss = compiled(params, opt_state, data[i % BATCHES])
            return loss
    else:
        extra = {"loss_scale": FP16_LOSS_SCALE} if args.dtype == "fp16" else {}
        extra.update(ZERO_VARIANTS[args.variant])
        # A factory: the state is created directly in its layout (DeepSpeed's zero.Init), the
        # same values as the plain variant's eager model (same seed).
        step = zeroxla.make_step(build_model,
                                 zeroxla.make_mesh(1, 1), optimizer=optimizer,
                                 config=zeroxla.ZeroConfig(compute_dtype=dtype_name,
                                                           **extra))
        state = step.init()
        lowered = step.lower(state, data[0])
        start = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start
        markers = common.guarded(SECTION, f"{args.variant} markers",
                                 lambda: program_markers_report(lowered, compiled))

        def one(i):
            nonlocal state
            state, metrics = compiled(state, data[i % BATCHES])
            return metrics["loss"]

    total = max(FIRST_LOSSES, WARMUP + args.steps)
    for i in range(total):
        start = time.perf_counter()
        loss = float(one(i))                       # waits for the step
        times.append(time.perf_counter() - start)
        if i < FIRST_LOSSES:
            losses.append(loss)
    seconds = sorted(times[WARMUP:])[len(times[WARMUP:]) // 2]
    tokens_per_s = args.batch * args.seq / seconds
    row = dict(variant=args.variant, model=args.model, layers=config.num_layers,
               logits_chunk=args.logits_chunk,
               dtype=args.dtype, seq=args.seq, batch=args.batch,
               packed=args.packed,
               attention=args.attention, attention_route=route, params=n_params,
               compile_s=round(compile_s, 2), step_s=seconds, tokens_per_s=round(tokens_per_s),
               flops_per_token=per_token, peak_flops=args.peak_flops,
               mfu=round(per_token * tokens_per_s / args.peak_flops, 4),
               losses=losses, peak_bytes=common.peak_bytes(), **common.compiled_bytes(compiled),
               markers=markers)
    return row


def program_markers_report(lowered, compiled):
    import program_markers

    return program_markers.report(lowered, compiled)


def child(args) -> None:
    """One variant, in this process; its row also goes to train_<tag>.json for the parent."""
    row = run_variant(args)
    common.record(SECTION, **row)
    (common.out_dir() / f"train_{tag(args, args.variant)}.json").write_text(json.dumps(row))


def tag(args, variant: str) -> str:
    return (f"{args.model}_L{args.layers or 0}_C{args.logits_chunk or 0}_{variant}_{args.dtype}_T{args.seq}_B{args.batch}{'_packed' if args.packed else ''}"
            f"{'_tiny' if args.tiny else ''}")


def parent(args) -> None:
    """Each variant in its own process (its own peak memory), then the comparison."""
    rows = {}
    for variant in args.variants:
        path = common.out_dir() / f"train_{tag(args, variant)}.json"
        path.unlink(missing_ok=True)
        command = [sys.executable, __file__, "--variant", variant] + forwarded(args)
        print(f"\n=== {SECTION} {args.model} {variant} {args.dtype} T={args.seq} B={args.batch}", flush=True)
        try:
            done = subprocess.run(command, timeout=args.timeout_each, env=os.environ.copy())
            if done.returncode:
                common.record(SECTION, variant=variant, dtype=args.dtype, seq=args.seq,
                              error=f"exit {done.returncode} (traceback above)")
        except subprocess.TimeoutExpired:
            common.record(SECTION, variant=variant, dtype=args.dtype, seq=args.seq,
                          error=f"timed out after {args.timeout_each} s")
        if path.exists():
            rows[variant] = json.loads(path.read_text())
    compare(rows, args)


def compare(rows: dict, args) -> None:
    """tokens/s, MFU and memory side by side; zeroxla against the plain step; first losses."""
    if not rows:
        return
    base = rows.get("plain")
    print(f"\n| variant | tokens/s | vs plain | MFU | peak GiB | temp GiB | compile s | "
          f"losses 1..{FIRST_LOSSES} |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base else "-"
        peak = f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") else "-"
        temp = f"{r['temp_bytes'] / 2**30:.2f}" if r.get("temp_bytes") is not None else "-"
        print(f"| {name} | {r['tokens_per_s']} | {ratio} | {r['mfu']:.3f} | {peak} | {temp} | "
              f"{r['compile_s']} | {', '.join(f'{x:.4f}' for x in r['losses'])} |")
    for name, r in rows.items():
        m = r.get("markers")
        if m:
            print(f"{name} program: CPU-branch markers {m['cpu_markers_total']} (0 expected on a "
                  f"GPU; by source {m['cpu_branch_ops']}, vector NaN tests "
                  f"{m['vector_nan_tests']}, transposes after a scatter "
                  f"{m['transpose_after_scatter']}); collectives {m['collectives']}; compiled "
                  f"{m.get('compiled')}")
    if base:
        for name, r in rows.items():
            if name != "plain":
                gap = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"]))
                common.record(SECTION, part="loss_check", variant=name, dtype=args.dtype,
                              seq=args.seq, max_rel_loss_gap_vs_plain=gap,
                              within_bf16_tolerance=gap <= 1e-2,
                              speed_vs_plain=r["tokens_per_s"] / base["tokens_per_s"])


def forwarded(args) -> list[str]:
    out = ["--dtype", args.dtype, "--seq", str(args.seq), "--batch", str(args.batch),
           "--steps", str(args.steps), "--attention", args.attention,
           "--peak-flops", str(args.peak_flops), "--model", args.model]
    out += ["--layers", str(args.layers)] if args.layers else []
    out += ["--logits-chunk", str(args.logits_chunk)] if args.logits_chunk else []
    return out + (["--tiny"] if args.tiny else []) + (["--packed"] if args.packed else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS,
                        default=["plain", "zero0", "zero3"])
    parser.add_argument("--variant", choices=VARIANTS, help="run this one variant here")
    parser.add_argument("--model", default="gpt2-124m",
                        help="gpt2-124m, or a preset of zeroxla.models.presets (Llama-3.1-8B)")
    parser.add_argument("--layers", type=int, default=None,
                        help="this many of the model's layers (its own count by default)")
    parser.add_argument("--logits-chunk", type=int, default=None,
                        help="tokens per chunk of the model's chunked head (its default: 1024)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after 2 warm-ups")
    parser.add_argument("--attention", default="auto",
                        help="models' attention implementation: auto, naive, blockwise, cudnn, "
                             "pallas")
    parser.add_argument("--packed", action="store_true",
                        help="packed rows with segment ids (module docstring)")
    parser.add_argument("--peak-flops", type=float, default=common.H100_PEAK_FLOPS)
    parser.add_argument("--timeout-each", type=float, default=150.0)
    parser.add_argument("--tiny", action="store_true", help=common.TINY_HELP)
    args = parser.parse_args()
    if args.tiny:
        args.seq, args.batch, args.steps = min(args.seq, 64), 2, 3
    if args.variant:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()

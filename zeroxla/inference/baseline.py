"""The generators the Hybrid Engine is measured against: ZeRO-3 generation without it
(`Zero3Generator`), and the same gathered model decoded on one device (`SingleDeviceGenerator`).

The parameters stay partitioned over the data axes as training stores them, and every forward
gathers each layer just before it runs (the training step's own `zero3_module` stand-ins), so
*every decoded token re-gathers the whole model*: what DeepSpeed does when ZeRO-3 generation
runs without the Hybrid Engine (DeepSpeedExamples#718: 72 s per generation, #764: ~700 ms per
token). It uses the same KV cache and decode loop as the engine, and the same sampling keys (a
row's draws depend on the seed and its own prompt, not on the device it lands on); rows are
split over all data devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroxla.engine.layout import ZeroLayout
from zeroxla.engine.layout_argument import layout_argument
from zeroxla.engine.state import TrainState, gather_params
from zeroxla.engine.wrap import local_model
from zeroxla.inference.checks import check_decodable, check_layout, check_state
from zeroxla.inference.decode import bucket, check_request, decode_loop, pack, unpack
from zeroxla.inference.sampling import Sampling


class Zero3Generator:
    """`generate(state, prompts, ...)` as `HybridEngine.generate`, re-gathering per token:
    `Zero3Generator(step.layout, max_out_tokens)`. Each device computes on the training step's
    own model copy (`engine.wrap.local_model`) from the stored parameters' compute inputs
    (`ShardingPlan.compute_inputs`). `Zero3Generator(step, ...)` still works and warns."""

    def __init__(self, layout: ZeroLayout, max_out_tokens: int = 512):
        layout = layout_argument(layout, "Zero3Generator(step, ...)",
                                 "Zero3Generator(step.layout, ...)")
        check_layout(layout, "Zero3Generator")
        if layout.config.stage != 3 or layout.axes.num_stages > 1:
            raise ValueError(f"Zero3Generator needs a ZeRO stage 3 step without pipeline "
                             f"stages; got stage={layout.config.stage}, "
                             f"stages={layout.axes.num_stages}; accepted: stage=3, stages=1")
        if layout.experts is not None:
            raise ValueError(f"Zero3Generator on a mesh whose 'expert' axis splits the "
                             f"model's experts over {layout.experts.size} devices: the decode "
                             "protocol takes no `experts=`, so it is not built; accepted: "
                             "zeroxla.HybridEngine(step.layout, ...) (experts placed whole "
                             "for inference), or make_mesh(..., expert=1)")
        self.layout = layout
        self.axes = layout.axes
        self.max_out_tokens = max_out_tokens
        self.vocab_size = layout.vocab_size
        self._cache_shape = check_decodable(layout.model_def, max_out_tokens, self.vocab_size)
        self._programs: dict[tuple, Any] = {}

    def _specs(self) -> tuple[Any, P, P]:
        data = self.axes.data
        return self.layout.plan.compute_input_specs(), P(None, data), P(data)

    def _local_model(self, params: dict[str, Any], model_state: dict[str, Any]) -> Any:
        model, _ = local_model(self.layout, params, model_state, None, training=False)
        return model

    def _program(self, batch: int, prompt: int, sampling: Sampling) -> Any:
        key = (batch, prompt, sampling)
        if key not in self._programs:
            params_spec, cache_spec, rows = self._specs()
            axes = self.axes.data

            def all_done(done):          # every device runs the same number of steps
                return lax.pmin(jnp.all(done).astype(jnp.int32), axes) > 0

            def local(params, model_state, cache, tokens, lengths, live, max_new, eos_id, key):
                # each row's keys come from the seed and its prompt (decode_loop), so the
                # device it lands on does not matter
                return decode_loop(self._local_model(params, model_state), cache, tokens,
                                   lengths, live, max_new, eos_id, key, sampling,
                                   self.max_out_tokens, all_done)

            run = jax.shard_map(local, mesh=self.layout.mesh, check_vma=False, in_specs=(
                params_spec, P(), {"k": cache_spec, "v": cache_spec}, rows, rows, rows, P(),
                P(), P()), out_specs=(rows, P(), {"k": cache_spec, "v": cache_spec}))
            self._programs[key] = jax.jit(run, donate_argnums=(2,))
        return self._programs[key]

    def _cache(self, batch: int) -> dict[str, jax.Array]:
        shape = list(self._cache_shape)
        shape[1] = batch
        sharding = NamedSharding(self.layout.mesh, self._specs()[1])
        return jax.jit(lambda: {k: jnp.zeros(shape, jnp.float32) for k in ("k", "v")},
                       out_shardings={"k": sharding, "v": sharding})()

    def generate(self, state: TrainState, prompts: Sequence[Any], max_new_tokens: int = 32,
                 temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, eos_id: int | None = None,
                 seed: int | jax.Array = 0, vocab_limit: int | None = None
                 ) -> list[np.ndarray]:
        """As `HybridEngine.generate` (the same tokens for the same seed, sampled too)."""
        rows, sampling, key = check_request(
            prompts, max_new_tokens, self.max_out_tokens, self.vocab_size,
            temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, seed=seed,
            vocab_limit=vocab_limit)
        check_state(state, self.layout.plan, self.layout.model_def)
        if max_new_tokens == 0:
            return [row.copy() for row in rows]
        batch = bucket(len(rows), multiple=self.axes.data_size)
        prompt = bucket(max(row.size for row in rows), limit=self.max_out_tokens)
        tokens, lengths, live = pack(rows, batch, prompt)
        buffer, steps, _ = self._program(batch, prompt, sampling)(
            self.layout.plan.compute_inputs(state.params), state.model_state,
            self._cache(batch),
            tokens, lengths, live, np.int32(max_new_tokens),
            np.int32(-1 if eos_id is None else eos_id), key)
        return unpack(rows, np.asarray(buffer), int(steps), eos_id)

    def token_program(self, state: TrainState, batch: int) -> Any:
        """One compiled decode step (T = 1) of `batch` rows: what each generated token costs
        (`comm_report(program, mesh=step.layout.mesh)` counts its gathers)."""
        params_spec, cache_spec, rows = self._specs()

        def local(params, model_state, cache, token, pos):
            return self._local_model(params, model_state).decode(token, pos, cache)

        run = jax.shard_map(local, mesh=self.layout.mesh, check_vma=False, in_specs=(
            params_spec, P(), {"k": cache_spec, "v": cache_spec}, rows, rows),
            out_specs=(rows, {"k": cache_spec, "v": cache_spec}))
        column = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
        return jax.jit(run).lower(self.layout.plan.compute_inputs(state.params),
                                  state.model_state, self._cache(batch), column, column).compile()


class SingleDeviceGenerator:
    """`generate(state, prompts, ...)` as `HybridEngine.generate`, on one device: the whole
    float32 model (`gather_params(state)`, the same values `gathered_model` holds, kept while
    the state's parameter arrays are the same ones), the same decode loop, KV cache and
    sampling keys, no collectives. The engine's tokens/s against this is the price (or the
    gain) of splitting the model over devices. `SingleDeviceGenerator(step.layout,
    max_out_tokens)`; `SingleDeviceGenerator(step, ...)` still works and warns."""

    def __init__(self, layout: ZeroLayout, max_out_tokens: int = 512):
        layout = layout_argument(layout, "SingleDeviceGenerator(step, ...)",
                                 "SingleDeviceGenerator(step.layout, ...)")
        check_layout(layout, "SingleDeviceGenerator")
        self.model_def, self.plan = layout.model_def, layout.plan
        self.max_out_tokens = max_out_tokens
        self.vocab_size = layout.vocab_size
        self._cache_shape = check_decodable(self.model_def, max_out_tokens, self.vocab_size)
        self.device = jax.local_devices()[0]
        self._programs: dict[tuple, Any] = {}
        self._pinned: tuple[list[Any], dict[str, jax.Array]] | None = None

    def params(self, state: TrainState) -> dict[str, jax.Array]:
        """{path: float32 array} of `state` on `self.device`, gathered once per parameters."""
        check_state(state, self.plan, self.model_def)
        leaves = jax.tree.leaves(state.params)
        if self._pinned is None or any(a is not b for a, b in zip(self._pinned[0], leaves)):
            logical = gather_params(state)                   # on this process's first device
            self._pinned = (leaves, dict(zip(self.model_def.paths,
                                             self.model_def.treedef.flatten_up_to(logical))))
        return self._pinned[1]

    def _program(self, batch: int, prompt: int, sampling: Sampling) -> Any:
        key = (batch, prompt, sampling)
        if key not in self._programs:
            def run(params, model_state, cache, tokens, lengths, live, max_new, eos_id, key):
                model = self.model_def.module(params, model_state)
                model.eval()
                return decode_loop(model, cache, tokens, lengths, live, max_new, eos_id, key,
                                   sampling, self.max_out_tokens)
            self._programs[key] = jax.jit(run, donate_argnums=(2,))
        return self._programs[key]

    def generate(self, state: TrainState, prompts: Sequence[Any], max_new_tokens: int = 32,
                 temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, eos_id: int | None = None,
                 seed: int | jax.Array = 0, vocab_limit: int | None = None
                 ) -> list[np.ndarray]:
        """As `HybridEngine.generate` (the same tokens for the same seed, sampled too)."""
        rows, sampling, key = check_request(
            prompts, max_new_tokens, self.max_out_tokens, self.vocab_size,
            temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, seed=seed,
            vocab_limit=vocab_limit)
        if max_new_tokens == 0:
            return [row.copy() for row in rows]
        params = self.params(state)
        batch = bucket(len(rows))
        prompt = bucket(max(row.size for row in rows), limit=self.max_out_tokens)
        shape = list(self._cache_shape)
        shape[1] = batch
        cache = {k: jnp.zeros(shape, jnp.float32, device=self.device) for k in ("k", "v")}
        inputs = jax.device_put((*pack(rows, batch, prompt), state.model_state,
                                 np.int32(max_new_tokens),
                                 np.int32(-1 if eos_id is None else eos_id), key), self.device)
        tokens, lengths, live, model_state, *scalars = inputs
        buffer, steps, _ = self._program(batch, prompt, sampling)(
            params, model_state, cache, tokens, lengths, live, *scalars)
        return unpack(rows, np.asarray(buffer), int(steps), eos_id)

"""A ZeRO step compiled for a shape with nothing allocated: abstract state, abstract batch.

    step = make_step(lambda: Llama(config, rngs=nnx.Rngs(0)), mesh, config=ZeroConfig(stage=3))
    compiled = compile_abstract(step, sequences=8, seq_len=32768)
    compiled.memory_analysis()

`make_step` given a model *factory* builds its layout from `nnx.eval_shape` (no parameter is
created), and the step's `jax.jit` traces from `jax.ShapeDtypeStruct`s that carry the state's
shardings (`layout.state_shardings`, offloaded parts with their host memory kind) and the batch's
(`layout.batch_sharding`). The program compiled is the one `step(state, batch)` runs for those
shapes: the same `jax.jit`, the same shardings, the same donation of the state.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from zeroxla.engine.logical import abstract_storage_state
from zeroxla.engine.state import TrainState
from zeroxla.engine.step import ZeroStep
from zeroxla.sharding.stored_forms import MasterWithCopy


def abstract_state(step: ZeroStep) -> TrainState:
    """The step's `TrainState` as `jax.ShapeDtypeStruct`s with their shardings (nothing
    allocated): the storage shapes of `abstract_storage_state`, the shardings the step's `jit`
    takes its state in."""
    layout = step.layout
    shapes = abstract_storage_state(layout)
    return jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                 sharding=sharding),
                        shapes, layout.state_shardings)


def abstract_batch(step: ZeroStep, sequences: int, seq_len: int) -> dict[str, Any]:
    """A next-token batch of `sequences` rows of `seq_len` int32 tokens (inputs, targets), as
    `jax.ShapeDtypeStruct`s split over the data devices."""
    token = jax.ShapeDtypeStruct((sequences, seq_len), jnp.int32,
                                 sharding=step.layout.batch_sharding)
    return {"inputs": token, "targets": token}


def trace_abstract(step: ZeroStep, sequences: int, seq_len: int) -> Any:
    """`jax.stages.Traced` of the step on an abstract state and a batch of `sequences` x
    `seq_len` tokens. The step is called as a user calls it (`step(state, batch)`: its batch
    check sees tracers, whose token ids it leaves alone, and its own `jit`, with its state
    shardings, is inlined), under a `jax.jit` that donates the state as the step's does."""
    multiple = step.layout.data_size * step.layout.config.gradient_accumulation_steps
    if sequences % multiple:
        raise ValueError(f"sequences={sequences} is not a multiple of the data-parallel size "
                         f"{step.layout.data_size} x gradient_accumulation_steps "
                         f"{step.layout.config.gradient_accumulation_steps} = {multiple}")
    return jax.jit(step, donate_argnums=0).trace(abstract_state(step),
                                                 abstract_batch(step, sequences, seq_len))


def compile_abstract(step: ZeroStep, sequences: int, seq_len: int) -> Any:
    """`jax.stages.Compiled` of `trace_abstract`'s program."""
    return trace_abstract(step, sequences, seq_len).lower().compile()


def _shard_bytes(struct: Any) -> int:
    """Bytes one device holds of `struct` (a `jax.ShapeDtypeStruct` with a sharding)."""
    shape = struct.sharding.shard_shape(struct.shape)
    return math.prod(shape) * jnp.dtype(struct.dtype).itemsize


def _in_host(struct: Any) -> bool:
    return getattr(struct.sharding, "memory_kind", None) not in (None, "device")


def state_bytes(state: TrainState) -> dict[str, int]:
    """Per-device bytes of an abstract state by part, largest over devices (the shards are
    even: every device holds the same shapes):

        master        the float32 master weights (the parameters themselves when no 16-bit
                      copy is kept)
        compute_copy  16-bit copies compute reads (`MasterWithCopy.compute`)
        optimizer     the optimizer state
        other         step counter, loss scale, seed, model state
        host_*        the same parts held in a host memory kind (ZeRO-Offload), apart
    """
    parts = {"master": 0, "compute_copy": 0, "optimizer": 0, "other": 0}
    host: dict[str, int] = {f"host_{name}": 0 for name in parts}

    def add(part: str, tree: Any) -> None:
        for struct in jax.tree.leaves(tree):
            if _in_host(struct):
                host[f"host_{part}"] += _shard_bytes(struct)
            else:
                parts[part] += _shard_bytes(struct)

    for value in state.params.values():
        if isinstance(value, MasterWithCopy):
            add("master", value.master)
            add("compute_copy", value.compute)
        else:
            add("master", value)
    add("optimizer", state.opt_state)
    add("other", (state.step, state.loss_scale, state.rng, state.model_state))
    return {**parts, **host}


__all__ = ["abstract_batch", "abstract_state", "compile_abstract", "state_bytes", "trace_abstract"]

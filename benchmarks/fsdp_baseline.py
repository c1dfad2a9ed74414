"""The GSPMD baselines of `benchmarks/zero.py`, shared with the test that pins ZeRO-3's peak
against them (`tests/zeroxla/analysis/test_peak_vs_fsdp.py`).

`jit_train_step(model, mode, mesh, batch)` compiles one jitted AdamW train step of `model`:

* `dp`: plain data parallelism. Every parameter and optimizer leaf replicated, the batch split
  over the data axes; XLA inserts the gradient all-reduce.
* `fsdp`: GSPMD FSDP the way MaxText runs it. Logical-axis rules put `embed` (and the batch) on
  the data axes and leave every other logical axis whole, parameters and optimizer state get
  those NamedShardings, the activations are constrained to the batch sharding at every layer
  boundary (MaxText's `activation_batch` constraints), and XLA inserts the collectives. A leaf
  with no `embed` dim (biases, norms) or one the data size does not divide stays replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroxla.engine.loss import token_cross_entropy
from zeroxla.models import axes
from zeroxla.models.layers import call_block, default_positions
from zeroxla.sharding.mesh import DATA_AXES

# MaxText-style logical-axis rules for pure FSDP: the batch and `embed` on the data axes ("fsdp"
# in MaxText), every other logical axis unsharded. The first matching rule wins.
FSDP_RULES = ((axes.BATCH, DATA_AXES), (axes.EMBED, DATA_AXES))


def fsdp_spec(logical: tuple[str | None, ...], shape: tuple[int, ...], devices: int) -> P:
    """The logical-axis rules applied to one parameter: the first dim whose name has a rule,
    if the data size divides it; else replicated (MaxText would refuse such a leaf)."""
    for d, name in enumerate(logical):
        for rule_name, mesh_axes in FSDP_RULES:
            if name == rule_name and shape[d] % devices == 0:
                spec: list = [None] * len(shape)
                spec[d] = mesh_axes
                return P(*spec)
    return P()


def constrained_forward(model, tokens: jax.Array, batch_sharding: NamedSharding) -> jax.Array:
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


@dataclasses.dataclass
class JitStep:
    """A compiled baseline step and its (donated) state: `run()` takes one step."""

    compiled: Any
    params: Any
    opt_state: Any
    batch: Any

    def run(self) -> jax.Array:
        self.params, self.opt_state, loss = self.compiled(self.params, self.opt_state,
                                                          self.batch)
        return loss


def jit_train_step(model: nnx.Module, mode: str, mesh, batch: dict[str, Any],
                   optimizer: optax.GradientTransformation | None = None) -> JitStep:
    """`mode` "dp": parameters replicated; "fsdp": the MaxText rules above. AdamW(1e-3) unless
    `optimizer` is given; zeroxla's default loss (mean token cross-entropy)."""
    if not all(hasattr(model, a) for a in ("embed", "blocks", "head")):
        raise ValueError(f"model {type(model).__name__} has no embed/blocks/head; the GSPMD "
                         "baselines replay that forward with activation constraints")
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = optimizer or optax.adamw(1e-3)
    n = mesh.devices.size
    batch_sh = NamedSharding(mesh, P(DATA_AXES))

    def sharding(v: nnx.Variable) -> nnx.Variable:
        logical = tuple(v.get_metadata()["logical_axes"])
        spec = fsdp_spec(logical, v.shape, n) if mode == "fsdp" else P()
        return v.replace(NamedSharding(mesh, spec))
    param_sh = jax.tree.map(sharding, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_state, param_sh,
                                   transform_non_params=lambda _: NamedSharding(mesh, P()))

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            module = nnx.merge(graphdef, p)
            if mode == "fsdp":
                logits = constrained_forward(module, batch["inputs"], batch_sh)
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
    return JitStep(jitted.lower(params, opt_state, batch).compile(), params, opt_state, batch)


def peak_bytes(compiled) -> int:
    """XLA's peak for a compiled program: arguments + temporaries + outputs - donated."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes)

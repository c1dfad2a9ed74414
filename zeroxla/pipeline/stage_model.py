"""The model on one pipeline stage, as functions of the parameters and a micro-batch.

    Block          one block called from a flat list of its parameters
    StageModel     the model cut at its stack (`zeroxla.pipeline.stages`) on this stage's
                   parameter values: the computation up to the stack (the first stage's), the
                   stage's blocks (plain, under a ZeRO-3 `GatheredStack`, or linearized keeping
                   their vjp residuals), and the computation after the stack with the loss
                   (the last stage's)

Runs inside the ZeRO step's `shard_map`, on one device's arrays; `zeroxla.pipeline.passes`
builds a schedule step's forward, backward and weight-gradient passes from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from zeroxla.engine import remat
from zeroxla.engine.gather import GatheredStack
from zeroxla.models.layers import call_block
from zeroxla.pipeline.stages import StagedLoss, loss_after_stack, stack_input, stop_gradients


@dataclasses.dataclass(frozen=True)
class Block:
    """How to call one block from a flat list of its parameters (stacked-leaf order)."""

    graphdef: Any
    treedef: Any
    paths: tuple[str, ...]          # the plan paths of its leaves, in that order

    def __call__(self, full: list[Any], x: Any, consts: tuple, keep: Any) -> tuple[Any, None]:
        block = nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, full))
        y, _ = call_block(block, x, consts, None)
        return jnp.where(keep, y, x), None          # a masked (padding) slot passes x through


@dataclasses.dataclass(frozen=True)
class StageModel:
    """The model cut at its stack (`zeroxla.pipeline.stages`), on this stage's parameter values.
    `p` below is a dict of trainable leaves (path -> value), the frozen ones fill the rest."""

    loss: StagedLoss
    model_def: Any
    block: Block
    trainable: dict[str, Any]       # path -> this stage's value (stacked leaves: [Lmax, ...])
    frozen: dict[str, Any]
    mask: jax.Array                 # [Lmax]: False on this stage's padding slots
    stack: GatheredStack | None     # ZeRO-3 per-micro-batch gathers of the blocks, else None
    block_leaves: tuple[Any, ...]   # the blocks' plan leaves, in `block.paths` order
    block_full: list[Any]           # their values (under `stack`: their shards)
    policy: str                     # the remat policy of the blocks' vjp
    dtype: Any

    def model_of(self, p: dict[str, Any]) -> Any:
        return self.model_def.module({**self.frozen, **p}, {}, None)

    def embed(self, p: dict[str, Any], micro: Any) -> jax.Array:    # -> [mb, T, D]
        """The model's computation up to its stack: the first stage's forward."""
        return stack_input(self.loss.terms, self.model_of(p), micro)[0].astype(self.dtype)

    def stack_args(self, micro: Any) -> tuple:                      # e.g. (positions [mb, T],)
        """The stack's other arguments; parameter-free (`check_stages`), so constants."""
        return stop_gradients(stack_input(self.loss.terms, self.model_of(self.trainable),
                                          micro)[1])

    def blocks_of(self, full: list[Any], x: jax.Array, consts: tuple) -> jax.Array:
        """The stage's blocks on x [mb, T, D] -> [mb, T, D]; `full` their leaves (or shards)."""
        if self.stack is not None:                             # full: the blocks' shards
            return self.stack(full, x, consts, self.mask)[0]

        def body(h, per_layer):
            layer, keep = per_layer
            return self.block(layer, h, consts, keep)[0], None
        return lax.scan(body, x, (full, self.mask))[0]

    def blocks(self, p: dict[str, Any], x: jax.Array, consts: tuple) -> jax.Array:
        return self.blocks_of([{**self.frozen, **p}[path] for path in self.block.paths], x,
                              consts)

    def linearized_blocks(self, x: jax.Array, consts: tuple) -> tuple[Any, list[Any], Any]:
        """(y, kept, layout): the blocks' forward keeping their vjp residuals less the
        parameters (`linearize_keeping`: a residual that *is* a parameter or shard is taken
        from `block_full` again in backward, never stashed per buffer)."""
        return remat.linearize_keeping(lambda full, x: self.blocks_of(full, x, consts),
                                       self.block_leaves, self.block_full, x, self.policy)

    def head_terms(self, p: dict[str, Any], y: jax.Array, micro: Any) -> tuple[Any, Any]:
        """The model's computation after its stack, and the loss: the last stage's.
        Returns (loss sum, token count)."""
        return loss_after_stack(self.loss.terms, self.model_of(p), micro, y)

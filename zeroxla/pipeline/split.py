"""Which of a model's layers run on which pipeline stage: DeepSpeed's layer list view.

DeepSpeed partitions a `PipelineModule`'s flat list of layers. A pipelined zeroxla model is its
loss cut at its `blocks` (one LayerStack; `zeroxla.pipeline.stages`); its layer list view is

    [embedding, block 0, ..., block L-1, head]

where "embedding" counts the parameters outside the stack that the stack's input is computed
from (GPT-2's tied `wte` counted once, there, as DeepSpeed's TiedLayerSpec owner) and "head"
the other parameters outside it, each entry with its class name (for "type:<regex>").
`partition_layers` cuts
that list into S contiguous parts; the embedding then lives on the first stage and the head on
the last (a partition of more entries than stages never leaves the first or last part empty),
and stage s runs blocks `first_layer[s] : first_layer[s] + num_layers[s]`, possibly none.

The executor runs the same program on every stage, so every stage scans `max_layers` layer
slots: `layer_index()[s]` says which stacked layer fills slot j on stage s, `layer_mask()[s]`
whether slot j is real (uneven splits pad with masked slots). Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from zeroxla.pipeline.partition import partition_layers

BLOCKS_PREFIX = "blocks/"


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """The blocks of each stage. `parts` are DeepSpeed's boundaries over `layer_names`."""

    layer_names: tuple[str, ...]       # the layer list view: embed, blocks..., head
    layer_params: tuple[int, ...]      # parameter count of each entry
    parts: tuple[int, ...]             # [S + 1] boundaries over the layer list view
    first_layer: tuple[int, ...]       # [S] first block (stacked layer index) of each stage
    num_layers: tuple[int, ...]        # [S] blocks on each stage (may be 0)

    @property
    def stages(self) -> int:
        return len(self.num_layers)

    @property
    def max_layers(self) -> int:
        """Layer slots every stage scans (the most blocks any stage has, at least one)."""
        return max(1, *self.num_layers)

    def layer_index(self) -> list[list[int]]:
        """[S][max_layers] the stacked layer in each slot (padding slots repeat a real index,
        masked out)."""
        total = sum(self.num_layers)
        return [[min(first + j, total - 1) for j in range(self.max_layers)]
                for first in self.first_layer]

    def layer_mask(self) -> list[list[bool]]:
        """[S][max_layers] whether each slot holds one of the stage's blocks."""
        return [[j < n for j in range(self.max_layers)] for n in self.num_layers]

    def describe(self) -> str:
        """One line per stage: its entries of the layer list view and their parameters."""
        lines = [f"pipeline: {self.stages} stages over the layer list view "
                 f"({len(self.layer_names)} entries), boundaries {list(self.parts)}"]
        for s in range(self.stages):
            lo, hi = self.parts[s], self.parts[s + 1]
            blocks = (f"blocks {self.first_layer[s]}..{self.first_layer[s] + self.num_layers[s] - 1}"
                      if self.num_layers[s] else "no blocks")
            held = ((["embedding"] if lo == 0 else []) + [blocks]
                    + (["head"] if hi == len(self.layer_names) else []))
            params = sum(self.layer_params[lo:hi])
            lines.append(f"  stage {s}: {', '.join(held)} ({params:,} parameters)")
        return "\n".join(lines)


def layer_list(model: Any, shapes: dict[str, tuple[int, ...]], embed_paths: tuple[str, ...],
               head_paths: tuple[str, ...]) -> list[tuple[str, int]]:
    """DeepSpeed's layer list view of `model` (concrete or abstract): `(class name, parameter
    count)` of the embedding, each block, and the head. `shapes` are the plan's parameter
    shapes by path (shared parameters appear once); `embed_paths` are the parameters outside
    the stack that its input is computed from (`stages.check_stages`: a tied GPT-2 `wte` counts
    there, as DeepSpeed's TiedLayerSpec owner), `head_paths` the other ones outside it."""
    stacked = {p: s for p, s in shapes.items() if p.startswith(BLOCKS_PREFIX)}
    num_layers = model.blocks.num_layers
    if not stacked or any(s[0] != num_layers for s in stacked.values()):
        raise ValueError(f"pipeline: the parameters under 'blocks/' must all be stacked "
                         f"[{num_layers}, ...] (a LayerStack)")
    per_block = sum(math.prod(s[1:]) for s in stacked.values())
    embed = sum(math.prod(shapes[p]) for p in embed_paths if p in shapes)
    head = sum(math.prod(shapes[p]) for p in head_paths if p in shapes)
    return ([(_name(model, "embed", "Embedding"), embed)]
            + [(type(model.blocks.layers).__name__, per_block)] * num_layers
            + [(_name(model, "head", "Head"), head)])


def _name(model: Any, attribute: str, default: str) -> str:
    """The class (or method) name of `model.<attribute>` for DeepSpeed's "type:<regex>"
    partitioning, `default` when the model has no such attribute."""
    part = getattr(model, attribute, None)
    if part is None:
        return default
    return part.__name__ if callable(getattr(part, "__func__", None)) else type(part).__name__


def split_stages(layers: list[tuple[str, int]], stages: int, method: str) -> StageSplit:
    """Partitions the layer list view (`layer_list`) over `stages` with `method`
    ("parameters", "uniform" or "type:<regex>"). ValueError when there are more stages than
    blocks."""
    num_blocks = len(layers) - 2
    if stages > num_blocks:
        raise ValueError(f"pipeline: stages={stages} (the mesh's 'stage' axis) exceeds the "
                         f"model's num_layers={num_blocks}; accepted: stages <= {num_blocks} "
                         "(make_mesh(stages=...)) or a deeper model")
    parts = partition_layers(layers, stages, method)
    first, counts = [], []
    for s in range(stages):
        # Entry i of the view is block i - 1; clamp to the blocks' range.
        lo = min(max(parts[s] - 1, 0), num_blocks)
        hi = min(max(parts[s + 1] - 1, 0), num_blocks)
        first.append(lo)
        counts.append(hi - lo)
    return StageSplit(tuple(n for n, _ in layers), tuple(c for _, c in layers), tuple(parts),
                      tuple(first), tuple(counts))

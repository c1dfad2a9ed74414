"""Pipeline storage: each stage stores only its own layers (DeepSpeed's PipelineModule memory).

Under `make_step(..., pipeline=...)` every stacked `LayerStack` leaf (`blocks/...`, logical
`[L, ...]`) is stored split over the mesh's `stage` axis (`PIPELINE_STORAGE_RULES`: layers ->
stage, the rest -> data). Stages may hold different numbers of layers, so the stored layer dim
has `S * max_layers` slots, stage s owning slots `[s * max_layers, (s + 1) * max_layers)`:

    slot s * max_layers + j   holds layer first_layer[s] + j   (j < num_layers[s])
                              padding                           (j >= num_layers[s]): zero

That is a storage layout of the same logical leaf (`LeafPlan.stage_slots`): `unpad` drops the
padding slots and returns the logical `[L, ...]`, so the optimizer, the global gradient norm,
clipping and checkpoints see exactly the layers of the unpipelined model; padding slots are
written back as zero after every update and never reach a statistic. The parameter, its
gradient and its optimizer state are each `[max_layers, ...]` per device (further partitioned
over the data axes by the ZeRO stage): 1/S of the unpipelined plan's layers when S divides L.
When every stage holds L / S layers the slots are the layers and the conversions are free.

The embedding, head and final norm stay stored as the ZeRO plan says (replicated over stages).
"""

from __future__ import annotations

import dataclasses

from zeroxla.sharding.mesh import MeshAxes
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.plan import ShardingPlan
from zeroxla.sharding.rules import PIPELINE_STORAGE_RULES
from zeroxla.pipeline.split import StageSplit


def stage_slots(split: StageSplit) -> tuple[int, ...]:
    """[S * max_layers] the logical layer in each stored slot, -1 for padding."""
    return tuple(layer if real else -1
                 for index, mask in zip(split.layer_index(), split.layer_mask())
                 for layer, real in zip(index, mask))


def pipelined_plan(plan: ShardingPlan, split: StageSplit, axes: MeshAxes) -> ShardingPlan:
    """`plan` with its stacked leaves stored split over `axes.stage` (a plan unchanged when
    there is one stage)."""
    if split.stages == 1:
        return plan
    slots = stage_slots(split)
    leaves = tuple(dataclasses.replace(leaf, stage_axis=axes.stage, stage_slots=slots,
                                       stage_count=split.stages) if leaf.stacked else leaf
                   for leaf in plan.leaves)
    padding = sum(layer < 0 for layer in slots)
    text = (split.describe() + f"\n  stacked leaves stored split over '{axes.stage}': "
            f"{split.max_layers} layer slots per stage ({padding} padding slots, zero)")
    return dataclasses.replace(plan, leaves=leaves, storage_rules=PIPELINE_STORAGE_RULES,
                               pipeline_description=text)


def stage_local(leaf: LeafPlan, layers: int | None) -> LeafPlan:
    """`leaf` as one stage sees it inside the `shard_map`: not split, with `layers` layer slots
    (None: the logical layer count), so `pad` / `unpad` / gathers act on the data dim only."""
    shape = leaf.shape if layers is None or not leaf.stacked else (layers, *leaf.shape[1:])
    return dataclasses.replace(leaf, shape=shape, stage_axis=None, stage_slots=(),
                               stage_count=1)

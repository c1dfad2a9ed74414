"""Expert parallelism in the ZeRO step: which modules run it, and what is refused.

On a mesh with an "expert" axis of EP > 1 devices (`make_mesh(expert=EP)`) the plan stores
every leaf with a dim named `experts` split over that axis (E / EP experts per device) and
ZeRO-partitioned over the other data axes, its expert-data group (`sharding.rules`,
`LeafPlan.expert_dim`); its gradients are reduced over that group only (the collectives read
each leaf's own `data_axes`). Every other leaf, and the batch, are data parallel over the
expert axis as over any data axis.

The layer that owns such a leaf must know it holds E / EP experts: the step sets
`expert_parallel` (a `models.expert_parallel.ExpertParallel`) on every module of its copy that
declares that attribute (`models.moe.MoeMLP`), as it sets BatchNorm's `axis_name`. A leaf named
`experts` under no such module (a user's own MoE layer) would compute with a slice of its
experts as if it were all of them: refused by name before anything is traced
(`check_expert_parallel`), as are the features not built with expert parallelism (the
pipeline, frozen leaves stored as codes).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from zeroxla.models.expert_parallel import ExpertParallel
from zeroxla.sharding.config import ZeroConfig
from zeroxla.sharding.mesh import MeshAxes
from zeroxla.sharding.model_def import ModelDef, path_str
from zeroxla.sharding.plan import ShardingPlan

ATTRIBUTE = "expert_parallel"


def expert_parallel(axes: MeshAxes) -> ExpertParallel | None:
    """The `ExpertParallel` of a mesh with an expert axis of more than one device, else None."""
    if axes.expert is None or axes.expert_size == 1:
        return None
    return ExpertParallel(axes.expert, axes.expert_size)


def _expert_modules(model: nnx.Module) -> dict[str, nnx.Module]:
    """{path: module} of the modules that declare `expert_parallel`."""
    return {path_str(path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Module) and hasattr(node, ATTRIBUTE)}


def place_experts(model: nnx.Module, ep: ExpertParallel | None) -> None:
    """Tells every expert-parallel module of `model` (a copy made inside the step) the expert
    axis it runs under (nothing without one)."""
    if ep is None:
        return
    for module in _expert_modules(model).values():
        setattr(module, ATTRIBUTE, ep)


def _refused_features(config: ZeroConfig, axes: MeshAxes) -> list[tuple[str, Any, str]]:
    """(field, value, accepted) of each feature not built with expert parallelism."""
    refused = []
    if config.quantized_nontrainable_weights:
        refused.append(("ZeroConfig.quantized_nontrainable_weights", True,
                        "False (hpZ, qwZ and qgZ do run with expert parallelism)"))
    if axes.num_stages > 1:
        refused.append(("the mesh's 'stage' axis", axes.num_stages, "stages=1"))
    return refused


def check_expert_parallel(model_def: ModelDef, plan: ShardingPlan, config: ZeroConfig,
                          axes: MeshAxes) -> None:
    """ValueError, naming the field or parameter, for what expert parallelism does not run
    exactly: frozen leaves stored as codes or the pipeline with it (not built), and a leaf split
    over the expert axis whose module does not declare `expert_parallel`. ZeRO++'s hpZ, qwZ
    and qgZ run on the dense leaves (expert leaves take the plain collectives,
    `collectives.zeropp`); offload keeps each leaf's layout, expert split included."""
    if expert_parallel(axes) is None:
        return
    for field, value, accepted in _refused_features(config, axes):
        raise ValueError(
            f"{field}={value!r} with the mesh's 'expert' axis of {axes.expert_size}: not built "
            f"with expert parallelism; accepted: {accepted}, or make_mesh(..., expert=1)")
    split = [leaf.path for leaf in plan.leaves if leaf.expert_split]
    owners = tuple(_expert_modules(model_def.abstract_module()))
    for path in split:
        if not any(path.startswith(owner + "/") or not owner for owner in owners):
            raise ValueError(
                f"parameter {path!r} has a dim named 'experts', which the mesh's 'expert' axis "
                f"of {axes.expert_size} splits (E / {axes.expert_size} experts per device), but "
                f"no module above it declares `{ATTRIBUTE}`: it would compute with a slice of "
                "its experts as if it were all of them. Accepted: zeroxla.models.moe.MoeMLP "
                "(or a module with an `expert_parallel` attribute that runs "
                "models.expert_parallel.expert_parallel_ffn), or make_mesh(..., expert=1)")


__all__ = ["check_expert_parallel", "expert_parallel", "place_experts"]

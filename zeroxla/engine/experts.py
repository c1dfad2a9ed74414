"""Expert parallelism in the ZeRO step: what the MoE layers are given, and what is refused.

On a mesh with an "expert" axis of EP > 1 devices (`make_mesh(expert=EP)`) the plan stores
every leaf with a dim named `experts` split over that axis (E / EP experts per device) and
ZeRO-partitioned over the other data axes, its expert-data group (`sharding.rules`,
`LeafPlan.expert_dim`); its gradients are reduced over that group only (the collectives read
each leaf's own `data_axes`). Every other leaf, and the batch, are data parallel over the
expert axis as over any data axis.

The layer that owns such a leaf must know it holds E / EP experts. The step tells it as it
tells attention about sequence parallelism: an argument. Where the plan splits a leaf over the
expert axis, the step passes the model's forward `experts=` (a
`models.expert_parallel.ExpertParallel`, `model_experts`) beside `sequence=`: the default loss
through `loss.model_token_logprobs`, a loss_fn of its own (which must declare `experts`) and
`TokenForward`'s fn as a keyword; the MoE family threads it through its stack to every
`models.moe.MoeMLP` call. Nothing is set on the model's modules. A leaf named `experts` under
no module whose `__call__` takes `experts` (a user's own MoE layer) would compute with a slice
of its experts as if it were all of them: refused by name before anything is traced
(`check_expert_parallel`), as are a loss_fn that cannot pass the argument on and the features
not built with expert parallelism (the pipeline, frozen leaves stored as codes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from zeroxla.engine.loss import EXPERTS_KEY, declares, next_token_loss
from zeroxla.models.expert_parallel import ExpertParallel
from zeroxla.sharding.config import ZeroConfig
from zeroxla.sharding.mesh import MeshAxes
from zeroxla.sharding.model_def import ModelDef, path_str
from zeroxla.sharding.plan import ShardingPlan


def expert_parallel(axes: MeshAxes) -> ExpertParallel | None:
    """The `ExpertParallel` of a mesh with an expert axis of more than one device, else None."""
    if axes.expert is None or axes.expert_size == 1:
        return None
    return ExpertParallel(axes.expert, axes.expert_size)


def model_experts(axes: MeshAxes, plan: ShardingPlan) -> ExpertParallel | None:
    """What the step passes the model as `experts=`: the mesh's `ExpertParallel` when the plan
    splits a leaf over the expert axis; None otherwise (a dense model on such a mesh is data
    parallel over it, and its forward is called as without one)."""
    ep = expert_parallel(axes)
    if ep is None or not any(leaf.expert_split for leaf in plan.leaves):
        return None
    return ep


def takes_experts(fn: Callable) -> bool:
    """Whether `fn` (a loss_fn, a `TokenForward` fn) declares the `experts` keyword."""
    return declares(fn, EXPERTS_KEY)


def _expert_modules(model: nnx.Module) -> dict[str, nnx.Module]:
    """{path: module} of the modules whose `__call__` takes `experts` (the expert layout)."""
    return {path_str(path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Module) and declares(type(node).__call__, EXPERTS_KEY)}


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
                          axes: MeshAxes, loss_fn: Callable[..., Any] = next_token_loss
                          ) -> None:
    """ValueError, naming the field or parameter, for what expert parallelism does not run
    exactly: frozen leaves stored as codes or the pipeline with it (not built), a leaf split
    over the expert axis under no module whose call takes `experts`, and a loss_fn of its own
    that does not declare `experts` (it could not pass the layout on). ZeRO++'s hpZ, qwZ and
    qgZ run on the dense leaves (expert leaves take the plain collectives,
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
                "no module above it declares `expert_parallel` by its call (a `__call__` "
                "taking `experts`, the ExpertParallel the step passes): it would compute with a "
                "slice of its experts as if it were all of them. Accepted: "
                "zeroxla.models.moe.MoeMLP (or a module whose __call__ takes experts= and runs "
                "models.expert_parallel.expert_parallel_ffn), or make_mesh(..., expert=1)")
    if split and loss_fn is not next_token_loss and not takes_experts(loss_fn):
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        raise ValueError(
            f"the mesh's 'expert' axis of {axes.expert_size} splits the experts of {split[0]!r} "
            f"(E / {axes.expert_size} per device), but loss_fn {name} takes no `experts` "
            "argument: it could not tell the model, whose MoE layers would refuse the call. "
            "Accepted: a loss_fn(model, batch, *, experts) that passes `experts` to the model "
            "(zeroxla.engine.loss.model_token_logprobs(..., experts=experts)); or "
            "make_mesh(..., expert=1)")


__all__ = ["check_expert_parallel", "expert_parallel", "model_experts", "takes_experts"]

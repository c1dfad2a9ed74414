"""The roles PPO, GRPO and DPO share, built in one place (Tunix's one object owning the actor /
reference / rollout roles):

    policy      LoRA adapters on a copy of the starting model (the caller's model stays plain),
                A drawn from `seed`; with `only_optimize_lora` the adapters alone train
    step        the policy's ZeRO `make_step` with the algorithm's `loss_fn`, and its first
                state `step.init(seed)`; `eval_steps`: forward-only programs of the same layout
                with other loss_fns (DPO's accuracy and margin)
    engine      the Hybrid Engine over the step's layout (PPO, GRPO: generation); with a
                `rollout_mesh`, over that mesh's devices instead: `rollout`, a `RolloutGroup`
                fed by weight syncs (asynchronous GRPO and PPO, `async_rollouts`)

`build_roles` builds them; `adapted` is its LoRA conversion alone (PPO's critic);
`batch_invariant_policy` the starting model in the batch-invariant mode (`--batch-invariant`);
`resolve_routing_replay` the routing replay mode a config's "auto" means for the built actor.
The frozen reference is a copy of the step's first state's partitions
(`answer_forward.reference_partitions`: LoRA's first adapters are B = 0, so it is the plain
starting model), never a whole model on one device.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import optax
from flax import nnx

import zeroxla
from zeroxla.engine.router_aux import has_router
from zeroxla.inference.checks import check_routing
from zeroxla.inference.rollout_group import RolloutGroup
from zeroxla.lora import LoRAConfig, convert_linear_layer_to_lora, lora_trainable

# ZeRO-3; a non-finite gradient skips its update (a run stops on the loss instead).
POLICY_ZERO = zeroxla.ZeroConfig(stage=3, check_grad_overflow=True)


def adapted(model: nnx.Module, lora: LoRAConfig | None, seed: int,
            trainable: Any = None) -> tuple[nnx.Module, Any]:
    """(`model` with `lora`'s adapters, `make_step`'s filter of the parameters to train).
    With an enabled `lora` the adapters go on a copy (the caller's `model` stays plain), their
    A drawn from `seed`, and `trainable` (None) becomes the adapters when `only_optimize_lora`;
    without one, (`model`, `trainable`) as given."""
    if lora is None or not lora.enabled:
        return model, trainable
    if trainable is not None and lora.only_optimize_lora:
        raise ValueError("trainable and lora.only_optimize_lora both choose the parameters to "
                         "train; accepted: one of them")
    model = nnx.clone(model)
    convert_linear_layer_to_lora(model, lora, rngs=nnx.Rngs(seed))
    return model, trainable if trainable is not None else lora_trainable(lora)


@dataclasses.dataclass(frozen=True)
class Roles:
    """What `build_roles` returns (see the module docstring)."""

    step: zeroxla.ZeroStep                # the policy's
    state: Any                            # step.init(seed), the trainer's to advance
    engine: zeroxla.HybridEngine | None   # None without a HybridEngineConfig
    eval_steps: dict[str, zeroxla.ZeroStep] = dataclasses.field(default_factory=dict)
    rollout: RolloutGroup | None = None   # with a rollout_mesh: `engine` is its engine


def batch_invariant_families() -> tuple[str, ...]:
    """The model families whose configs build the batch-invariant mode (`BATCH_INVARIANT`)."""
    return tuple(sorted(name for name, family in zeroxla.models.REGISTRY.items()
                        if getattr(family.config_class, "BATCH_INVARIANT", False)))


def batch_invariant_policy(model: nnx.Module, owner: str, inference_tp_size: int,
                           tp_name: str) -> nnx.Module:
    """`model`'s weights in the batch-invariant mode (`models.invariant`): its config rebuilt
    with batch_invariant=True (the model itself when it is already), so that the ZeRO step's
    training forward and the Hybrid Engine reading its partitions both sum in a fixed order.
    ValueError naming `owner` (the option or field asking) for a family without the mode, and
    naming `tp_name` for a tensor-parallel rollout (its projections sum over devices)."""
    config = getattr(model, "config", None)
    if not getattr(config, "BATCH_INVARIANT", False):
        kind = getattr(config, "family", None) or type(model).__name__
        raise ValueError(f"{owner} with a {kind} actor: the batch-invariant mode is not built "
                         f"for its family; accepted: an actor of the families "
                         f"{', '.join(batch_invariant_families())}")
    if inference_tp_size != 1:
        raise ValueError(f"{owner} with {tp_name}={inference_tp_size}: a tensor-parallel "
                         f"rollout sums each projection over devices; accepted: {tp_name}=1")
    if config.batch_invariant:
        return model
    mode = zeroxla.models.abstract_model(config.replace(batch_invariant=True))
    return nnx.merge(nnx.graphdef(mode), nnx.state(model))


def _replay_blocker(config: Any, model: Any) -> str | None:
    """Why "on" cannot run for the MoE actor `model` under `config` (None: it can)."""
    if not all(callable(getattr(type(model), name, None))
               for name in ("decode_choices", "replayed_token_logprobs")):
        return (f"a {type(model).__name__} actor's decode records no routing, or its forward "
                "replays none (decode_choices, replayed_token_logprobs: built for the MoE "
                "Llama families, gpt-oss, Qwen3.5-MoE and Gemma 4's MoE block)")
    if not config.packing:
        return "packing=False (the replayed forward is the packed one)"
    if getattr(config, "partial_rollout", 0):
        return (f"partial_rollout={config.partial_rollout} (a carried answer's tokens are "
                "routed by several weight versions)")
    return None


def resolve_routing_replay(config: Any, model_def: Any) -> Any:
    """`config` (a GRPOConfig or PPOConfig) with `routing_replay` resolved for the actor the
    step built (`model_def`), an explicit mode other than "off" checked to be recordable
    (`check_routing`: ValueError naming return_routing for an actor without routing records).

    "auto" is "on" for a Mixture-of-Experts actor (router statistics or `num_experts`) and
    "off" for a dense one: replay is measured exact (0 mismatches), so an MoE actor trains on
    its rollout's experts unless told otherwise. Where "on" cannot run for an MoE actor (its
    decode records no routing, `packing=False`, `partial_rollout`), "auto" is "off" and one
    warning names the reason: such a run trains as any unreplayed run does (every token routed
    live), a correct loss without replay's protection against routing drift, and refusing there
    would refuse runs that ask for nothing by name. An explicit "on" or "measure" there is
    refused by name, as the config's own checks and `check_routing` do."""
    if config.routing_replay != "auto":
        if config.routing_replay != "off":
            check_routing(model_def)
        return config
    model = model_def.abstract_module()
    moe = has_router(model) or bool(getattr(getattr(model, "config", None), "num_experts", 0))
    blocker = _replay_blocker(config, model) if moe else None
    if blocker is not None:
        warnings.warn(f"{type(config).__name__}.routing_replay='auto' is 'off' for this MoE "
                      f"actor: {blocker}; the rollout's routing is not replayed", stacklevel=3)
    return config.replace(routing_replay="on" if moe and blocker is None else "off")


def build_roles(model: nnx.Module, mesh: Any, *, optimizer: optax.GradientTransformation,
                loss_fn: Callable, seed: int, lora: LoRAConfig | None = None,
                zero_config: zeroxla.ZeroConfig = POLICY_ZERO, trainable: Any = None,
                eval_loss_fns: Mapping[str, Callable] | None = None,
                hybrid_engine: zeroxla.HybridEngineConfig | None = None,
                rollout_mesh: Any = None, batch_invariant: bool = False) -> Roles:
    """The adapted policy's ZeRO step on `mesh` with `optimizer`, `loss_fn` and
    `zero_config` (`trainable`: see `adapted`) and its first state, a step of the same policy per `eval_loss_fns` entry, and
    with `hybrid_engine` the Hybrid Engine over the step's layout (over `rollout_mesh`, disjoint
    from `mesh`, when given: a `RolloutGroup`), all from plain `model`; with
    `batch_invariant`, from `model` in the batch-invariant mode (`batch_invariant_policy`)."""
    if batch_invariant:
        tp = 1 if hybrid_engine is None else hybrid_engine.inference_tp_size
        model = batch_invariant_policy(model, "batch_invariant=True", tp, "inference_tp_size")
    policy, trainable = adapted(model, lora, seed, trainable)

    def step_for(fn: Callable) -> zeroxla.ZeroStep:
        return zeroxla.make_step(policy, mesh, optimizer=optimizer, config=zero_config,
                                 loss_fn=fn, trainable=trainable)
    step = step_for(loss_fn)
    eval_steps = {name: step_for(fn) for name, fn in (eval_loss_fns or {}).items()}
    state = step.init(seed)
    rollout = (None if hybrid_engine is None or rollout_mesh is None
               else RolloutGroup(step.layout, rollout_mesh, hybrid_engine))
    engine = (None if hybrid_engine is None else rollout.engine if rollout is not None
              else zeroxla.HybridEngine(step.layout, hybrid_engine))
    return Roles(step, state, engine, eval_steps, rollout)


__all__ = ["POLICY_ZERO", "Roles", "adapted", "batch_invariant_families", "batch_invariant_policy",
           "build_roles", "resolve_routing_replay"]

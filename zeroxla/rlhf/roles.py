"""The roles PPO, GRPO and DPO share, built in one place (Tunix's one object owning the actor /
reference / rollout roles):

    policy      LoRA adapters on a copy of the starting model (the caller's model stays plain),
                A drawn from `seed`; with `only_optimize_lora` the adapters alone train
    step        the policy's ZeRO `make_step` with the algorithm's `loss_fn`, and its first
                state `step.init(seed)`; `eval_steps`: forward-only programs of the same layout
                with other loss_fns (DPO's accuracy and margin)
    engine      the Hybrid Engine over the step's layout (PPO, GRPO: generation)

`build_roles` builds them; `adapted` is its LoRA conversion alone (PPO's critic). The frozen
reference is a copy of the step's first state's partitions (`answer_forward.reference_partitions`:
LoRA's first adapters are B = 0, so it is the plain starting model), never a whole model on one
device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import optax
from flax import nnx

import zeroxla
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


def build_roles(model: nnx.Module, mesh: Any, *, optimizer: optax.GradientTransformation,
                loss_fn: Callable, seed: int, lora: LoRAConfig | None = None,
                zero_config: zeroxla.ZeroConfig = POLICY_ZERO, trainable: Any = None,
                eval_loss_fns: Mapping[str, Callable] | None = None,
                hybrid_engine: zeroxla.HybridEngineConfig | None = None) -> Roles:
    """The adapted policy's ZeRO step on `mesh` with `optimizer`, `loss_fn` and
    `zero_config` (`trainable`: see `adapted`) and its first state, a step of the same policy per `eval_loss_fns` entry, and
    with `hybrid_engine` the Hybrid Engine over the step's layout, all from plain `model`."""
    policy, trainable = adapted(model, lora, seed, trainable)

    def step_for(fn: Callable) -> zeroxla.ZeroStep:
        return zeroxla.make_step(policy, mesh, optimizer=optimizer, config=zero_config,
                                 loss_fn=fn, trainable=trainable)
    step = step_for(loss_fn)
    eval_steps = {name: step_for(fn) for name, fn in (eval_loss_fns or {}).items()}
    state = step.init(seed)
    engine = None if hybrid_engine is None else zeroxla.HybridEngine(step.layout, hybrid_engine)
    return Roles(step, state, engine, eval_steps)


__all__ = ["POLICY_ZERO", "Roles", "adapted", "build_roles"]

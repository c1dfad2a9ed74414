"""`ZeroLayout`: everything fixed about a ZeRO step before it computes anything, as one value.

The training step, the pipeline executor, checkpoints, the Hybrid Engine and the analysis all
need the same facts: the mesh and its axis roles, the `ZeroConfig`, the model's static half, the
sharding plan, the collectives, the optimizer's layout and the state's shardings. They get this
one frozen value instead of the step object. It is built once, in a fixed order, each part from
the ones before it (as torchtitan's `parallelize` applies its parallelisms one after another):

    1. axes        the mesh's axis roles, checked (`sharding.mesh.check_mesh`)
    2. config      validated against the mesh (hpZ and MiCS sizes divide the local axis, ...)
    3. plan        every parameter's storage and compute layout (`sharding.plan.plan_for`)
    4. comm        the collectives that move them (ZeRO, stage 2's sinks, or ZeRO++)
    5. optimizer   the optax transformation over the plan (`engine.optimizer.ShardedOptimizer`)
    6. shardings   of the whole `TrainState` (offloaded parts in host memory,
                   `engine.offload`) and of a batch

`with_plan` replaces step 3's result and redoes 5-6 (the pipeline stores each stage's layers only,
`zeroxla.pipeline.storage.pipelined_plan`); `model_plan` keeps the plan of the whole model, which
evaluation and the plain step run under. Two facts are derived on first use and kept with the
layout: `logical` (the state's mesh-independent form and its two jitted conversions, what
checkpoints read and write) and `vocab_size` (the width of the model's logits).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zeroxla.collectives.zero import Zero2Collectives, ZeroCollectives
from zeroxla.collectives.zeropp import ZeroPPCollectives
from zeroxla.engine.experts import check_expert_parallel, model_experts
from zeroxla.engine.logical import LogicalLayout, build_layout
from zeroxla.engine.loss import LossFn, next_token_loss
from zeroxla.engine.loss_scale import init_loss_scale
from zeroxla.engine.offload import host_shardings
from zeroxla.engine.optimizer import ShardedOptimizer, default_optimizer
from zeroxla.engine.randomness import takes_rngs
from zeroxla.engine.sequence import batch_spec, check_sequence_parallel, sequence_parallel
from zeroxla.models.expert_parallel import ExpertParallel
from zeroxla.models.sequence_parallel import SequenceParallel
from zeroxla.engine.state import TrainState
from zeroxla.sharding.config import ZeroConfig
from zeroxla.sharding.mesh import MeshAxes, check_mesh
from zeroxla.sharding.model_def import Filter, ModelDef, frozen_paths, placeable
from zeroxla.sharding.plan import ShardingPlan, plan_for


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a step's model comes from: its static half, the parameters it starts from (a
    module's current values, or a zero-argument factory called inside `init` so that no device
    holds the whole model), and which parameters are frozen."""
    model_def: ModelDef
    initial_values: dict[str, Any] | None        # {path: value}; None with a factory
    initial_model_state: dict[str, Any] | None
    factory: Callable[[], nnx.Module] | None
    frozen: frozenset[str]

    @classmethod
    def of(cls, model: nnx.Module | Callable[[], nnx.Module],
           trainable: Filter | None) -> ModelSource:
        if isinstance(model, nnx.Module):
            model_def, values = ModelDef.of(model)
            source = cls(model_def, {p: placeable(v) for p, v in values.items()},
                         {p: placeable(v) for p, v in ModelDef.model_state_of(model).items()},
                         None, frozenset(frozen_paths(model, trainable)))
        elif callable(model):
            abstract = nnx.eval_shape(model)
            source = cls(ModelDef.of(abstract)[0], None, None, model,
                         frozenset(frozen_paths(abstract, trainable)))
        else:
            raise TypeError(f"make_step: model must be an nnx.Module or a factory returning one, "
                            f"got {type(model).__name__}")
        if len(source.frozen) == len(source.model_def.paths):
            raise ValueError(f"make_step: trainable={trainable!r} selects none of the model's "
                             f"parameters {list(source.model_def.paths[:5])}...; pass a filter "
                             "that selects at least one (None trains all)")
        return source


@dataclasses.dataclass(frozen=True, eq=False)
class ZeroLayout:
    """One step's mesh, config, model definition, plan, collectives, optimizer layout and
    shardings (see the module docstring for the order they are built in)."""
    mesh: Mesh
    axes: MeshAxes
    config: ZeroConfig
    model_def: ModelDef
    plan: ShardingPlan                  # the stored layout (per stage when pipelined)
    model_plan: ShardingPlan            # the whole model's: evaluation's and the plain step's
    comm: ZeroCollectives
    optimizer: optax.GradientTransformation
    sharded_optimizer: ShardedOptimizer
    state_shardings: TrainState
    batch_sharding: NamedSharding
    loss_fn: LossFn
    trainable: Filter | None
    uses_rng: bool                      # random draws anywhere: the state carries a seed

    @property
    def data_size(self) -> int:
        """Rows of the batch are split over this many devices (the data replicas; the ZeRO
        group is `axes.data_size`, the sequence devices with them)."""
        return self.axes.replicas

    @property
    def sequence(self) -> SequenceParallel | None:
        """How each sequence is split under sequence parallelism (None without it): what the
        step passes the model and a loss_fn declaring `sequence`."""
        return sequence_parallel(self.axes, self.config.sequence_parallel_strategy)

    @property
    def experts(self) -> ExpertParallel | None:
        """How the MoE layers' experts are split under expert parallelism (None without it, or
        for a model with no leaf split over the expert axis): what the step passes the model
        and a loss_fn as `experts=` (`engine.experts`)."""
        return model_experts(self.axes, self.model_plan)

    @property
    def loss_takes_rngs(self) -> bool:
        return takes_rngs(self.loss_fn)

    @functools.cached_property
    def logical(self) -> LogicalLayout:
        """The mesh- and stage-independent form of the state stored in this layout (what
        checkpoints store), with its two jitted conversions; built on first use."""
        return build_layout(self)

    @functools.cached_property
    def vocab_size(self) -> int:
        """The last dim of the model's logits, from an abstract evaluation (no compute): token
        ids of the default loss's batches and of generation prompts lie in [0, vocab_size)."""
        def logits_of(values, model_state, tokens):
            model = self.model_def.module(values, model_state)
            model.eval()                     # shapes only: no dropout, no statistics
            return model(tokens)
        logits = jax.eval_shape(logits_of, *self.model_def.abstract_values(),
                                jax.ShapeDtypeStruct((1, 1), jnp.int32))
        return int(logits.shape[-1])

    def eval_inputs(self, params: dict[str, Any]) -> dict[str, Any]:
        """The stored `params` as an evaluation program reads them, laid out by `model_plan`'s
        compute specs: each leaf's compute input, a pipeline's stage padding removed (the
        whole model runs, unpipelined)."""
        return {leaf.path: leaf.stage_unpad(leaf.compute_input(params[leaf.path]))
                for leaf in self.plan.leaves}

    def with_plan(self, plan: ShardingPlan) -> ZeroLayout:
        """This layout storing parameters as `plan` says (steps 5-6 redone); `model_plan` kept.
        The optimizer was checked on the logical parameters, which no plan changes."""
        sharded_optimizer = ShardedOptimizer(self.optimizer, plan, self.model_def)
        return dataclasses.replace(
            self, plan=plan, sharded_optimizer=sharded_optimizer,
            state_shardings=_state_shardings(self.mesh, self.config, plan, self.model_def,
                                             sharded_optimizer, self.uses_rng))


def zero_layout(source: ModelSource, mesh: Mesh, *,
                optimizer: optax.GradientTransformation | None = None,
                config: ZeroConfig | None = None, loss_fn: LossFn | None = None,
                trainable: Filter | None = None) -> ZeroLayout:
    """Builds the layout in the module docstring's order; every refusal names its argument."""
    axes = check_mesh(mesh)                                                    # 1
    config = config if config is not None else ZeroConfig()                    # 2
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"make_step: config must be a ZeroConfig, got {type(config).__name__}")
    config.validate_for_mesh(axes.local_size, axes.data_size, axes.sequence_size)
    model_def = source.model_def
    plan = plan_for(model_def, config, axes, frozen=source.frozen)             # 3
    loss_fn = loss_fn if loss_fn is not None else next_token_loss
    check_expert_parallel(model_def, plan, config, axes, loss_fn)
    comm = (ZeroPPCollectives.from_config(config, axes) if config.uses_zeropp  # 4
            else Zero2Collectives(axes, config.dtype) if config.stage == 2
            else ZeroCollectives(axes, config.dtype))
    optimizer = optimizer if optimizer is not None else default_optimizer()
    sharded_optimizer = ShardedOptimizer(optimizer, plan, model_def)          # 5
    sharded_optimizer.check()        # refuses, by name, transformations it cannot run exactly
    check_sequence_parallel(axes, loss_fn)
    # Random numbers drawn anywhere (model-held RNG streams, a loss_fn taking `rngs`): the
    # state then carries the run's seed (`TrainState.rng`).
    uses_rng = bool(model_def.rng_leaves) or takes_rngs(loss_fn)
    return ZeroLayout(                                                         # 6
        mesh=mesh, axes=axes, config=config, model_def=model_def, plan=plan, model_plan=plan,
        comm=comm, optimizer=optimizer, sharded_optimizer=sharded_optimizer,
        state_shardings=_state_shardings(mesh, config, plan, model_def, sharded_optimizer,
                                         uses_rng),
        batch_sharding=NamedSharding(mesh, batch_spec(axes)), loss_fn=loss_fn,
        trainable=trainable, uses_rng=uses_rng)


def _state_shardings(mesh: Mesh, config: ZeroConfig, plan: ShardingPlan, model_def: ModelDef,
                     sharded_optimizer: ShardedOptimizer, uses_rng: bool) -> TrainState:
    def named(spec):
        return NamedSharding(mesh, spec)
    replicated = named(P())
    loss_scale = (jax.tree.map(lambda _: replicated, init_loss_scale(config))
                  if config.uses_loss_scaling else None)
    # A leaf stored as codes has a pytree of specs (codes and scales).
    params = {leaf.path: jax.tree.map(named, leaf.param_spec) for leaf in plan.leaves}
    # ZeRO-Offload: the optimizer state and float32 masters carry a host memory kind.
    params, opt_state = host_shardings(config, plan, params,
                                       sharded_optimizer.state_shardings(mesh))
    return TrainState(step=replicated, params=params, opt_state=opt_state,
                      loss_scale=loss_scale, plan=plan, model_def=model_def,
                      model_state={p: replicated for p in model_def.state_paths},
                      rng=replicated if uses_rng else None)

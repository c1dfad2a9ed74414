"""`ZeroStep`: the ZeRO training step, one pure function compiled once (`zeroxla.make_step`).

    step = make_step(model, mesh, optimizer=optax.adamw(1e-3), config=ZeroConfig(stage=3))
    state = step.init()
    state, metrics = step(state, batch)

One `jax.jit` holds two parts:

1. the gradient pass, inside `jax.shard_map` over the mesh, so every collective is explicit:

       for each micro-batch (gradient accumulation):
           forward + backward            stage 3: per-layer all_gather / re-gather / psum_scatter
                                         stage 2: per-layer psum_scatter (no gather)
       reduce gradients                  stage 0-1: psum; stage 2-3: psum of the leaves left
                                         replicated (persistent, or scalars) only

2. the update (`engine.apply`), on globally shaped arrays outside the `shard_map`: unscale and
   overflow check (fp16), global norm and clipping, then the optax transformation on the logical
   parameters (`ShardedOptimizer`): elementwise optimizers compute on each device's partition and
   move no bytes; statistics over a whole tensor (norms, factored moments) get XLA's reductions. At
   stages 1-2 (and for stage 3's persistent leaves) the updated partitions are all-gathered back
   into the replicated parameters; under bf16/fp16 the float32 master stays a partition and its
   16-bit rounding is gathered into the 16-bit copy compute reads (`leaf_plan.MasterWithCopy`).

`trainable` (an nnx filter) chooses the parameters to train; the others are frozen: the loss is
differentiated only with respect to the trainable ones, and frozen leaves have no gradient, no
gradient collective, no optimizer state and no update. At stage 3 they are still partitioned and
gathered for compute; with `ZeroConfig.quantized_nontrainable_weights` they are stored as
int8/int4 codes, quantized once by `init`.

The loss is `(sum, count)` internally (`zeroxla.engine.loss`): the reported loss and the
gradients are the mean over the global batch's (unmasked) tokens.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroxla.collectives.zero import GradientSink
from zeroxla.engine.apply import apply_gradients
from zeroxla.engine.batch_checks import check_batch
from zeroxla.engine.gradients import differentiated, reduce_gradients, reduced_once
from zeroxla.engine.host_update import update_placement
from zeroxla.engine.layout import ModelSource, ZeroLayout
from zeroxla.engine.logical import LogicalLayout, build_layout
from zeroxla.engine.loss import (
    Batch,
    loss_terms,
    next_token_loss,
    next_token_loss_terms,
    normalizer,
)
from zeroxla.engine import offload
from zeroxla.engine.loss_scale import init_loss_scale
from zeroxla.engine.model_state import cross_replica_batch_norm, model_state_variables
from zeroxla.engine.optimizer import default_optimizer
from zeroxla.engine.randomness import (
    CALL_STREAM,
    device_key,
    micro_batch_key,
    seed_key_data,
    step_key,
)
from zeroxla.engine.state import TrainState
from zeroxla.engine.stored import logical_to_storage
from zeroxla.engine.update import gradient_spec
from zeroxla.engine.wrap import zero3_module
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.model_def import ModelDef, frozen_paths


class ZeroStep:
    """A compiled ZeRO training step. Call it; `init`, `lower` and `eval_loss` are beside it.

    Built by `zeroxla.make_step` from a `ModelSource` and a `ZeroLayout`; `gradient_pass` (the
    pipeline executor, for `pipeline=`) replaces the plain gradient pass and checks batches
    against its micro-batches; the update is the same either way."""

    def __init__(self, source: ModelSource, layout: ZeroLayout, *, gradient_pass: Any = None):
        offload.check_offload(layout.config, layout.plan, pipelined=gradient_pass is not None)
        self.update_placement = update_placement(layout)    # host or device, traced once
        self.layout = layout
        self.source = source
        # The layout's parts, under the names the step has always had.
        self.axes, self.mesh, self.config = layout.axes, layout.mesh, layout.config
        self.data_size, self.model_def = layout.data_size, layout.model_def
        self.optimizer, self.loss_fn, self.trainable = (layout.optimizer, layout.loss_fn,
                                                        layout.trainable)
        self.plan, self._model_plan, self.comm = layout.plan, layout.model_plan, layout.comm
        self.sharded_optimizer = layout.sharded_optimizer
        self.state_shardings, self.batch_sharding = layout.state_shardings, layout.batch_sharding
        self.uses_rng, self._loss_takes_rngs = layout.uses_rng, layout.loss_takes_rngs
        self._factory = source.factory
        self._initial_values = source.initial_values
        self._initial_model_state = source.initial_model_state
        # pipeline=PipelineConfig(...): the gradient pass runs the schedule over the stage axis
        # (`zeroxla.pipeline.executor`); each stage stores only its layers (`layout.plan`),
        # evaluation runs the unpipelined model on the layers gathered over the stages.
        self.pipeline = gradient_pass
        mesh = layout.mesh
        self._gradients = jax.shard_map(
            self._local_gradients if gradient_pass is None else gradient_pass.local_gradients,
            mesh=mesh,
            in_specs=(self._param_specs(), P(self.axes.data), P(), P(), P()),
            out_specs=(P(), {leaf.path: self._gradient_spec(leaf)
                             for leaf in self.plan.trainable_leaves}, P()),
            check_vma=False)
        replicated = NamedSharding(mesh, P())
        self._jitted = jax.jit(self._step, in_shardings=(self.state_shardings, None),
                               out_shardings=(self.state_shardings, replicated),
                               donate_argnums=0)
        self._jitted_init = jax.jit(self._init_state, out_shardings=self.state_shardings)
        self._compiled: dict[Any, Any] = {}       # `compile`'s cache, by argument signature
        local_eval = jax.shard_map(
            self._local_eval, mesh=mesh,
            in_specs=({leaf.path: leaf.compute_input_spec for leaf in self._model_plan.leaves},
                      P(), P(self.axes.data)),
            out_specs=P(), check_vma=False)
        self._jitted_eval = jax.jit(
            lambda params, model_state, batch: local_eval(
                {leaf.path: leaf.stage_unpad(leaf.compute_input(params[leaf.path]))
                 for leaf in self.plan.leaves},
                model_state, batch))

    # ------------------------------------------------------------------------------------------
    # Public surface.
    def init(self, seed: int | jax.Array = 0) -> TrainState:
        """The initial state, built directly in its sharded layout (like DeepSpeed's zero.Init:
        with a model factory, no device ever holds the full model). `seed` (an int or a
        `jax.random.key`) seeds every random draw of the run (dropout; see
        `zeroxla.engine.randomness`); it is unused when the model draws none."""
        return self._jitted_init(self._initial_values, self._initial_model_state,
                                 self._seed(seed))

    def init_from(self, values: dict[str, jax.Array], seed: int | jax.Array = 0) -> TrainState:
        """The initial state from every parameter's full value, `{path: array [logical shape]}`
        (a pretrained checkpoint's: `zeroxla.load_pretrained` passes each array already spread
        over the mesh, so that no device ever holds a whole leaf). Shapes are checked; a model
        with state besides its parameters is refused (its state has no source here)."""
        self.model_def.check_values(values, "init_from")
        return self._jitted_init(dict(values), {}, self._seed(seed))

    def lower_init(self) -> Any:
        """`jax.stages.Lowered` of `init`, e.g. for the memory analysis of its compiled program."""
        return self._jitted_init.lower(self._initial_values, self._initial_model_state,
                                       self._seed(0))

    def _seed(self, seed: int | jax.Array) -> jax.Array | None:
        key_data = seed_key_data(seed)
        return key_data if self.uses_rng else None

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on the global `batch`; `state` is donated."""
        return self._jitted(state, self._check_batch(batch))

    def lower(self, state: TrainState, batch: Batch) -> Any:
        """`jax.stages.Lowered` of the step, for `.compile()`, `.as_text()`, memory analysis."""
        return self._jitted.lower(state, self._check_batch(batch))

    def compile(self, state: TrainState, batch: Batch) -> Any:
        """`jax.stages.Compiled` of the step for these argument shapes, compiled once and kept
        (`memory_report` and `comm_report` read it; `state` may be abstract)."""
        def signature(x):
            return (tuple(x.shape), str(x.dtype), getattr(x, "sharding", None))
        key = (jax.tree.structure((state, batch)),
               tuple(signature(x) for x in jax.tree.leaves((state, batch))))
        if key not in self._compiled:
            self._compiled[key] = self.lower(state, batch).compile()
        return self._compiled[key]

    def eval_loss(self, state: TrainState, batch: Batch) -> jax.Array:
        """Mean loss over the global batch, no update, with the model in evaluation mode
        (`nnx.Module.eval()`: BatchNorm uses its running statistics, Dropout is off)."""
        return self._jitted_eval(state.params, state.model_state,
                                 self._check_batch(batch, accumulation=1))

    @functools.cached_property
    def logical_layout(self) -> LogicalLayout:
        """The mesh- and stage-independent form of this step's state (what checkpoints store),
        with its two jitted conversions; built on first use."""
        return build_layout(self.layout)

    def gathered_model(self, state: TrainState) -> nnx.Module:
        """A plain model holding the full parameters of `state` (see `gathered_model`)."""
        from zeroxla.engine.state import gathered_model
        return gathered_model(state)

    def describe(self) -> str:
        """The sharding plan's table, where offloaded state lives and where the update runs
        (`engine.offload`, `engine.host_update`)."""
        return (f"{offload.describe(self.config, self.update_placement.describe())}\n"
                f"{self.plan.describe()}")

    def describe_collectives(self) -> list[tuple[str, str, str, str]]:
        """(path, forward gather, backward gather, gradient reduction) per partitioned leaf."""
        return [(leaf.path, *self.comm.describe(leaf)) for leaf in self.plan.leaves
                if leaf.params_partitioned]

    # ------------------------------------------------------------------------------------------
    # Layouts.
    def _param_specs(self) -> dict[str, Any]:
        """Specs of the parameters the gradient pass reads (`_compute_inputs`)."""
        return {leaf.path: leaf.compute_input_spec for leaf in self.plan.leaves}

    def _compute_inputs(self, params: dict[str, Any]) -> dict[str, Any]:
        """`state.params` -> what the gradient pass reads: a leaf stored with a 16-bit compute
        copy (`MasterWithCopy`) gives the copy, never its float32 master partition."""
        return {leaf.path: leaf.compute_input(params[leaf.path]) for leaf in self.plan.leaves}

    def _gradient_spec(self, leaf: LeafPlan) -> P:
        """Layout of a trainable leaf's reduced gradient leaving the gradient pass."""
        return gradient_spec(leaf, self.config.stage)

    def _init_state(self, values: dict[str, jax.Array] | None,
                    model_state: dict[str, jax.Array] | None,
                    rng: jax.Array | None) -> TrainState:
        if values is None:
            model = self._factory()
            _, values = ModelDef.of(model)
            model_state = ModelDef.model_state_of(model)
        params, logical = {}, {}
        for leaf in self.plan.leaves:
            full = jnp.asarray(values[leaf.path], self.config.master_dtype)
            params[leaf.path] = logical_to_storage(leaf, full)  # frozen codes: quantized once, here
            if leaf.trainable:
                logical[leaf.path] = full
        return TrainState(
            step=jnp.int32(0), params=params, opt_state=self.sharded_optimizer.init(logical),
            loss_scale=init_loss_scale(self.config) if self.config.uses_loss_scaling else None,
            plan=self.plan, model_def=self.model_def, model_state=dict(model_state), rng=rng)

    def _check_batch(self, batch: Batch, accumulation: int | None = None) -> dict[str, Any]:
        """Validates the global batch (`zeroxla.engine.batch_checks.check_batch`)."""
        k = self.config.gradient_accumulation_steps if accumulation is None else accumulation
        if self.pipeline is not None and accumulation is None:
            self.pipeline.check_batch(batch)         # names PipelineConfig.micro_batches
            k = self.pipeline.config.micro_batches
        return check_batch(batch, next_token=self.loss_fn is next_token_loss,
                           data_size=self.data_size, accumulation=k,
                           vocab_size=lambda: self.vocab_size)

    @functools.cached_property
    def vocab_size(self) -> int:
        """The last dim of the model's logits (from an abstract evaluation, no compute): token
        ids in the default loss's batch must lie in [0, vocab_size)."""
        def logits_of(values, model_state, tokens):
            model = self.model_def.module(values, model_state)
            model.eval()                     # shapes only: no dropout, no statistics
            return model(tokens)
        logits = jax.eval_shape(logits_of, *self.model_def.abstract_values(),
                                jax.ShapeDtypeStruct((1, 1), jnp.int32))
        return int(logits.shape[-1])

    # ------------------------------------------------------------------------------------------
    # The gradient pass: inside shard_map, everything below sees one device's local arrays.
    def _local_model(self, params: dict[str, jax.Array], model_state: dict[str, jax.Array],
                     key: jax.Array | None, *, training: bool = True, reduced_once:
                     frozenset[str] = frozenset(), uses: Counter | None = None) -> tuple[Any, Any]:
        """This device's copy of the model (stage 3: wrapped to gather its partitions) and a
        function reading its model state after a forward pass, averaged over the data devices.
        `reduced_once` and `uses` go to `zero3_module` (stage 2's weights used more than once).

        BatchNorm statistics are computed over the global batch (`axis_name` = the data axes,
        Flax's cross-replica BatchNorm), as on one device with the whole batch. The model's RNG
        streams are keyed from `key`, this device's and micro-batch's key."""
        dtype = self.config.dtype
        if self.config.stage < 3:      # stage 2's sinks are cast per unit (Zero2Collectives)
            values = {p: v if isinstance(v, GradientSink) else v.astype(dtype)
                      for p, v in params.items()}
        else:
            values = {leaf.path: params[leaf.path] if leaf.params_partitioned
                      else params[leaf.path].astype(dtype) for leaf in self.plan.leaves}
        model = self.model_def.module(values, model_state, key)
        if not training:
            model.eval()
        variables = model_state_variables(model)
        cross_replica_batch_norm(model, self.axes.data)
        if self.config.stage == 3 or (self.config.stage == 2 and training):
            # Stage 2 gathers nothing, so there is nothing to prefetch.
            prefetch = self.config.prefetch and self.config.stage == 3
            max_live = self.config.max_live_parameters if self.config.stage == 3 else None
            model = zero3_module(model, self._model_plan, self.comm, prefetch, self.config.remat,
                                 reduced_once=reduced_once, uses=uses, max_live=max_live)

        def read_state() -> dict[str, jax.Array]:
            return {p: lax.pmean(v.get_value(), self.axes.data)
                    if jnp.issubdtype(v.get_value().dtype, jnp.inexact) else v.get_value()
                    for p, v in variables.items()}
        return model, read_state

    def _terms(self, model: Any, batch: Batch,
               key: jax.Array | None) -> tuple[jax.Array, jax.Array, bool]:
        """`(sum, count, is_sum)`: the loss of `batch` as a sum and a count; `is_sum` is False
        for a loss_fn that returned a scalar mean (its count is 1). A loss_fn declaring `rngs`
        gets `nnx.Rngs` seeded from `key`."""
        if self.loss_fn is next_token_loss:
            return (*next_token_loss_terms(model, batch), True)
        if self._loss_takes_rngs:
            rngs = nnx.Rngs(jax.random.fold_in(key, CALL_STREAM))
            value = self.loss_fn(model, batch, rngs=rngs)
        else:
            value = self.loss_fn(model, batch)
        return (*loss_terms(value, "loss_fn"), isinstance(value, (tuple, list)))

    def _local_gradients(self, params: dict[str, Any], batch: Batch, scale: jax.Array,
                         model_state: dict[str, jax.Array], key_data: jax.Array | None
                         ) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array]]:
        """The global mean loss and its gradients (times `scale`) of the trainable leaves,
        reduced over the data devices (partitioned where `update.gradient_padded`).

        Each micro-batch piece differentiates `sum * scale / c0` (c0 a static size of the piece,
        so gradients have mean-like magnitudes); after the reduction the gradients are
        multiplied by c0 / (the count over all devices and micro-batches): the exact mean.
        """
        k = self.config.gradient_accumulation_steps
        master = self.config.master_dtype       # gradients are summed in the master dtype
        trainable = {leaf.path: params[leaf.path] for leaf in self.plan.trainable_leaves}
        frozen = {p: v for p, v in params.items() if p not in trainable}
        wrt, as_values = differentiated(self.comm, self.plan, trainable,
                                        sinked=offload.sinked_paths(self.config, self.plan))
        sizes: list[float] = []          # the static c0 chosen while tracing `objective`

        base = (None if key_data is None else
                device_key(jax.random.wrap_key_data(key_data), self.axes.data))

        def forward(p, micro, ms, index, once=frozenset(), uses=None):
            key = None if base is None else micro_batch_key(base, index)
            model, read_state = self._local_model({**frozen, **as_values(p)}, ms, key,
                                                  reduced_once=once, uses=uses)
            return *self._terms(model, micro, key), read_state

        micro_batches = jax.tree.map(lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:]), batch)
        # Stage 2: the weights used by more than one call, reduced once (`reduced_once`).
        once = reduced_once(self.comm, self.plan, lambda uses: forward(
            wrt, jax.tree.map(lambda a: a[0], micro_batches), model_state, 0, uses=uses)[0])

        def objective(p, micro, ms, index):
            total, count, is_sum, read_state = forward(p, micro, ms, index, once)
            c0 = normalizer(micro) if is_sum else 1.0
            sizes.append(c0)
            return total * (scale / c0), (total, count, read_state())

        grad_fn = jax.grad(objective, has_aux=True)
        if k == 1:
            grads, (total, count, model_state) = grad_fn(wrt, batch, model_state, 0)
            grads = jax.tree.map(lambda g: g.astype(master), grads)
        else:
            def accumulate(carry, piece):
                # The model state (batch statistics) flows from micro-batch to micro-batch.
                micro, index = piece
                total_sum, count_sum, grad_sum, ms = carry
                g, (total, count, ms) = grad_fn(wrt, micro, ms, index)
                return (total_sum + total, count_sum + count,
                        jax.tree.map(lambda s, gi: s + gi.astype(master), grad_sum, g),
                        ms), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, master), wrt)   # partitions
            (total, count, grads, model_state), _ = lax.scan(
                accumulate, (jnp.float32(0), jnp.float32(0), zeros, model_state),
                (micro_batches, jnp.arange(k)))
        grads = reduce_gradients(grads, self.plan, self.config.stage, self.axes,
                                 self.config.dtype)
        total = lax.psum(total, self.axes.data)
        count = lax.psum(count, self.axes.data)
        count = jnp.where(count > 0, count, 1.0)
        factor = sizes[0] / count
        return total / count, jax.tree.map(lambda g: g * factor, grads), model_state

    def _local_eval(self, params: dict[str, Any], model_state: dict[str, jax.Array],
                    batch: Batch) -> jax.Array:
        key = jax.random.key(0) if self.uses_rng else None     # evaluation draws nothing
        model, _ = self._local_model(params, model_state, key, training=False)
        total, count, _ = self._terms(model, batch, key)
        total = lax.psum(total, self.axes.data)
        count = lax.psum(count, self.axes.data)
        return total / jnp.where(count > 0, count, 1.0)

    # ------------------------------------------------------------------------------------------
    # The step: the gradient pass, then the update on global arrays (`engine.apply`).
    def _step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        cfg = self.config
        scale = state.loss_scale.scale if cfg.uses_loss_scaling else jnp.float32(1)
        key_data = (None if state.rng is None else
                    jax.random.key_data(step_key(state.rng, state.step)))
        loss, grads, model_state = self._gradients(self._compute_inputs(state.params), batch,
                                                   scale, state.model_state, key_data)
        return apply_gradients(self.layout, state, loss, grads, model_state, scale,
                               on_host=self.update_placement.on_host)


__all__ = ["ZeroStep", "default_optimizer", "frozen_paths", "next_token_loss"]

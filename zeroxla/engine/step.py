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
   16-bit rounding is gathered into the 16-bit copy compute reads (`stored_forms.MasterWithCopy`).

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
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroxla.compat.cache import check_persistent_cache
from zeroxla.engine.apply import apply_gradients
from zeroxla.engine.batch_checks import check_accumulation, check_batch
from zeroxla.engine.consumption import proven_call
from zeroxla.engine.gradients import differentiated, reduce_gradients, reduced_once
from zeroxla.engine.host_update import update_placement
from zeroxla.engine.layout import ModelSource, ZeroLayout
from zeroxla.engine.loss import Batch, next_token_loss, normalizer
from zeroxla.engine import offload
from zeroxla.engine.objective import Objective
from zeroxla.engine.loss_scale import init_loss_scale
from zeroxla.engine.optimizer import default_optimizer
from zeroxla.engine.randomness import device_key, micro_batch_key, seed_key_data, step_key
from zeroxla.engine.sequence import batch_spec, check_sequence_batch, in_sequence_layout
from zeroxla.engine.state import TrainState
from zeroxla.engine.stored import logical_to_storage
from zeroxla.engine.update import gradient_spec
from zeroxla.engine.wrap import local_model
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.model_def import ModelDef, frozen_paths


class ZeroStep:
    """A compiled ZeRO training step. Call it; `init`, `lower` and `eval_loss` are beside it.

    Built by `zeroxla.make_step` from a `ModelSource` and a `ZeroLayout`, which it holds once,
    as `source` and `layout`: every fact of the step is read there (`step.layout.mesh`,
    `step.layout.plan`, ...). Its other attributes are what runs: the compiled functions, where
    the update runs (`update_placement`) and `pipeline`, the gradient pass given as
    `gradient_pass` (the pipeline executor, for `pipeline=`), which replaces the plain one and
    checks batches against its micro-batches; the update is the same either way."""

    def __init__(self, source: ModelSource, layout: ZeroLayout, *, gradient_pass: Any = None):
        offload.check_offload(layout.config, layout.plan, pipelined=gradient_pass is not None)
        self.layout = layout
        self.source = source
        self.update_placement = update_placement(layout)    # host or device, traced once
        # pipeline=PipelineConfig(...): the gradient pass runs the schedule over the stage axis
        # (`zeroxla.pipeline.executor`); each stage stores only its layers (`layout.plan`),
        # evaluation runs the unpipelined model on the layers gathered over the stages.
        self.pipeline = gradient_pass
        self.objective = Objective(layout)    # the loss and its opt-in terms, per forward
        mesh = layout.mesh
        replicated = NamedSharding(mesh, P())
        # The micro-batch count is static (argument 2): a call that names its own
        # (`gradient_accumulation_steps=`, e.g. an RL token budget's) compiles for it.
        self._jitted = jax.jit(self._step, in_shardings=(layout.state_shardings, None),
                               out_shardings=(layout.state_shardings, replicated),
                               static_argnums=2, donate_argnums=0)
        self._jitted_init = jax.jit(self._init_state, out_shardings=layout.state_shardings)
        self._compiled: dict[Any, Any] = {}       # `compile`'s cache, by argument signature
        local_eval = jax.shard_map(
            self._local_eval, mesh=mesh,
            in_specs=(layout.model_plan.compute_input_specs(), P(), batch_spec(layout.axes)),
            out_specs=P(), check_vma=False)
        self._jitted_eval = jax.jit(    # the model proven to use sequence= / packing keys
            lambda params, model_state, batch: proven_call(local_eval, (
                layout.eval_inputs(params), model_state,
                in_sequence_layout(batch, layout.sequence)), layout, batch_at=2))

    # ------------------------------------------------------------------------------------------
    # Public surface.
    def init(self, seed: int | jax.Array = 0) -> TrainState:
        """The initial state, built directly in its sharded layout (like DeepSpeed's zero.Init:
        with a model factory, no device ever holds the full model). `seed` (an int or a
        `jax.random.key`) seeds every random draw of the run (dropout; see
        `zeroxla.engine.randomness`); it is unused when the model draws none."""
        self._check_cache()
        return self._jitted_init(self.source.initial_values, self.source.initial_model_state,
                                 self._seed(seed))

    def init_from(self, values: dict[str, jax.Array], seed: int | jax.Array = 0) -> TrainState:
        """The initial state from every parameter's full value, `{path: array [logical shape]}`
        (a pretrained checkpoint's: `zeroxla.load_pretrained` passes each array already spread
        over the mesh, so that no device ever holds a whole leaf). Shapes are checked; a model
        with state besides its parameters is refused (its state has no source here)."""
        self.layout.model_def.check_values(values, "init_from")
        self._check_cache()
        return self._jitted_init(dict(values), {}, self._seed(seed))

    def lower_init(self) -> Any:
        """`jax.stages.Lowered` of `init`, e.g. for the memory analysis of its compiled program."""
        return self._jitted_init.lower(self.source.initial_values,
                                       self.source.initial_model_state, self._seed(0))

    def _check_cache(self) -> None:
        """Before a program of the step compiles or runs: JAX's persistent cache, refused over
        CPU devices before jax 0.12 (`zeroxla.compat.cache`), may have been switched on since
        `make_step` checked it."""
        check_persistent_cache(self.layout.mesh.devices.flat)

    def _seed(self, seed: int | jax.Array) -> jax.Array | None:
        key_data = seed_key_data(seed)
        return key_data if self.layout.uses_rng else None

    def __call__(self, state: TrainState, batch: Batch, *,
                 gradient_accumulation_steps: int | None = None
                 ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on the global `batch`; `state` is donated.
        `gradient_accumulation_steps`: the micro-batches each device's rows are cut into (None:
        the config's); each count compiles once. The update is the same for any count, but for
        a weighed MoE auxiliary loss: each micro-batch's, averaged (`engine.router_aux`)."""
        k = self._accumulation(gradient_accumulation_steps)
        self._check_cache()
        return self._jitted(state, self._check_batch(batch, k), k)

    def trace(self, state: TrainState, batch: Batch, *,
              gradient_accumulation_steps: int | None = None) -> Any:
        """`jax.stages.Traced` of the step (`.lower(lowering_platforms=...)`: e.g. the program
        a GPU would run, `zeroxla.compat.lowering.lower_for_cuda(step, state, batch)`)."""
        k = self._accumulation(gradient_accumulation_steps)
        return self._jitted.trace(state, self._check_batch(batch, k), k)

    def lower(self, state: TrainState, batch: Batch, *,
              gradient_accumulation_steps: int | None = None) -> Any:
        """`jax.stages.Lowered` of the step, for `.compile()`, `.as_text()`, memory analysis."""
        return self.trace(state, batch,
                          gradient_accumulation_steps=gradient_accumulation_steps).lower()

    def compile(self, state: TrainState, batch: Batch, *,
                gradient_accumulation_steps: int | None = None) -> Any:
        """`jax.stages.Compiled` of the step for these argument shapes, compiled once and kept
        (`memory_report` and `comm_report` read it; `state` may be abstract)."""
        def signature(x):
            return (tuple(x.shape), str(x.dtype), getattr(x, "sharding", None))
        k = self._accumulation(gradient_accumulation_steps)
        key = (jax.tree.structure((state, batch)), k,
               tuple(signature(x) for x in jax.tree.leaves((state, batch))))
        self._check_cache()
        if key not in self._compiled:
            self._compiled[key] = self.lower(state, batch,
                                             gradient_accumulation_steps=k).compile()
        return self._compiled[key]

    def _accumulation(self, requested: int | None) -> int | None:
        return check_accumulation(requested, pipelined=self.pipeline is not None)

    def eval_loss(self, state: TrainState, batch: Batch) -> jax.Array:
        """Mean loss over the global batch, no update, with the model in evaluation mode
        (`nnx.Module.eval()`: BatchNorm uses its running statistics, Dropout is off)."""
        self._check_cache()
        return self._jitted_eval(state.params, state.model_state,
                                 self._check_batch(batch, accumulation=1))

    def gathered_model(self, state: TrainState) -> nnx.Module:
        """A plain model holding the full parameters of `state` (see `gathered_model`)."""
        from zeroxla.engine.state import gathered_model
        return gathered_model(state)

    def describe(self) -> str:
        """The sharding plan's table, where offloaded state lives and where the update runs
        (`engine.offload`, `engine.host_update`)."""
        return (f"{offload.describe(self.layout.config, self.update_placement.describe())}\n"
                f"{self.layout.plan.describe()}")

    def describe_collectives(self) -> list[tuple[str, str, str, str]]:
        """(path, forward gather, backward gather, gradient reduction) per partitioned leaf."""
        return [(leaf.path, *self.layout.comm.describe(leaf)) for leaf in self.layout.plan.leaves
                if leaf.params_partitioned]

    # ------------------------------------------------------------------------------------------
    # Layouts.
    def _gradient_spec(self, leaf: LeafPlan) -> P:
        """Layout of a trainable leaf's reduced gradient leaving the gradient pass."""
        return gradient_spec(leaf, self.layout.config.stage)

    def _init_state(self, values: dict[str, jax.Array] | None,
                    model_state: dict[str, jax.Array] | None,
                    rng: jax.Array | None) -> TrainState:
        layout, config = self.layout, self.layout.config
        if values is None:
            model = self.source.factory()
            _, values = ModelDef.of(model)
            model_state = ModelDef.model_state_of(model)
        params, logical = {}, {}
        for leaf in layout.plan.leaves:
            full = jnp.asarray(values[leaf.path], config.master_dtype)
            params[leaf.path] = logical_to_storage(leaf, full)  # frozen codes: quantized once, here
            if leaf.trainable:
                logical[leaf.path] = full
        return TrainState(
            step=jnp.int32(0), params=params, opt_state=layout.sharded_optimizer.init(logical),
            loss_scale=init_loss_scale(config) if config.uses_loss_scaling else None,
            plan=layout.plan, model_def=layout.model_def, model_state=dict(model_state), rng=rng)

    def _check_batch(self, batch: Batch, accumulation: int | None = None) -> dict[str, Any]:
        """Validates the global batch (`zeroxla.engine.batch_checks.check_batch`)."""
        layout = self.layout
        k = layout.config.gradient_accumulation_steps if accumulation is None else accumulation
        if self.pipeline is not None and accumulation is None:
            self.pipeline.check_batch(batch)         # names PipelineConfig.micro_batches
            k = self.pipeline.config.micro_batches
        checked = check_batch(batch, next_token=layout.loss_fn is next_token_loss,
                              data_size=layout.data_size, accumulation=k,
                              vocab_size=lambda: layout.vocab_size)
        if layout.sequence is not None:
            check_sequence_batch(checked, layout.sequence)
        return checked

    # ------------------------------------------------------------------------------------------
    # The gradient pass: inside shard_map, everything below sees one device's local arrays.
    def _gradients(self, accumulation: int | None) -> Any:
        """The gradient pass over the mesh (`shard_map`) with `accumulation` micro-batches
        (None: the config's), or the pipeline executor's."""
        layout = self.layout
        plan = layout.plan
        if self.pipeline is not None:
            local = self.pipeline.local_gradients
        else:
            local = functools.partial(self._local_gradients, accumulation=(
                layout.config.gradient_accumulation_steps if accumulation is None
                else accumulation))
        return jax.shard_map(
            local, mesh=layout.mesh,
            in_specs=(plan.compute_input_specs(), batch_spec(layout.axes), P(), P(), P()),
            out_specs=(P(), {leaf.path: self._gradient_spec(leaf)
                             for leaf in plan.trainable_leaves}, P()),
            check_vma=False)

    def _local_gradients(self, params: dict[str, Any], batch: Batch, scale: jax.Array,
                         model_state: dict[str, jax.Array], key_data: jax.Array | None,
                         accumulation: int = 1
                         ) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array]]:
        """The global mean loss and its gradients (times `scale`) of the trainable leaves,
        reduced over the data devices (partitioned where `update.gradient_padded`).

        Each micro-batch piece differentiates `sum * scale / c0` (c0 a static size of the piece,
        so gradients have mean-like magnitudes); after the reduction the gradients are
        multiplied by c0 / (the count over all devices and micro-batches): the exact mean.
        """
        layout = self.layout
        config, plan, data = layout.config, layout.plan, layout.axes.data
        k = accumulation
        master = config.master_dtype       # gradients are summed in the master dtype
        trainable = {leaf.path: params[leaf.path] for leaf in plan.trainable_leaves}
        frozen = {p: v for p, v in params.items() if p not in trainable}
        wrt, as_values = differentiated(layout.comm, plan, trainable,
                                        sinked=offload.sinked_paths(config, plan))
        sizes: list[float] = []          # the static c0 chosen while tracing `objective`

        base = (None if key_data is None else
                device_key(jax.random.wrap_key_data(key_data), data))

        def forward(p, micro, ms, index, once=frozenset(), uses=None):
            key = None if base is None else micro_batch_key(base, index)
            model, read_state = local_model(layout, {**frozen, **as_values(p)}, ms, key,
                                            reduced_once=once, uses=uses)
            return self.objective.terms(model, micro, key), read_state

        micro_batches = jax.tree.map(lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:]), batch)
        # Stage 2: the weights used by more than one call, reduced once (`reduced_once`).
        once = reduced_once(layout.comm, plan, lambda uses: forward(
            wrt, jax.tree.map(lambda a: a[0], micro_batches), model_state, 0, uses=uses)[0].total)
        extra = self.objective.extra(batch, k)    # the loss's opt-in terms (`engine.objective`)

        def objective(p, micro, ms, index):
            terms, read_state = forward(p, micro, ms, index, once)
            c0 = normalizer(micro) if terms.is_sum else 1.0
            sizes.append(c0)
            value, logged = extra.add(terms.total * (scale / c0), terms.stats, terms.count,
                                      scale, c0)
            return value, (terms.total, terms.count, logged, read_state())

        grad_fn = jax.grad(objective, has_aux=True)
        if k == 1:
            grads, (total, count, logged, model_state) = grad_fn(wrt, batch, model_state, 0)
            grads = jax.tree.map(lambda g: g.astype(master), grads)
        else:
            def accumulate(carry, piece):
                # The model state (batch statistics) flows from micro-batch to micro-batch.
                micro, index = piece
                total_sum, count_sum, logged_sum, grad_sum, ms = carry
                g, (total, count, logged, ms) = grad_fn(wrt, micro, ms, index)
                return (total_sum + total, count_sum + count,
                        jax.tree.map(jnp.add, logged_sum, logged),
                        jax.tree.map(lambda s, gi: s + gi.astype(master), grad_sum, g),
                        ms), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, master), wrt)   # partitions
            (total, count, logged, grads, model_state), _ = lax.scan(
                accumulate, (jnp.float32(0), jnp.float32(0), extra.zeros, zeros, model_state),
                (micro_batches, jnp.arange(k)))
        grads = reduce_gradients(grads, plan, config.stage, layout.axes, config.dtype)
        total = lax.psum(total, data)
        count = lax.psum(count, data)
        count = jnp.where(count > 0, count, 1.0)
        factor = sizes[0] / count
        return (extra.metrics(total / count, logged), jax.tree.map(lambda g: g * factor, grads),
                model_state)

    def _local_eval(self, params: dict[str, Any], model_state: dict[str, jax.Array],
                    batch: Batch) -> jax.Array:
        key = jax.random.key(0) if self.layout.uses_rng else None   # evaluation draws nothing
        model, _ = local_model(self.layout, params, model_state, key, training=False)
        terms = self.objective.terms(model, batch, key)
        data = self.layout.axes.data
        total = lax.psum(terms.total, data)
        count = lax.psum(terms.count, data)
        return self.objective.eval_loss(total / jnp.where(count > 0, count, 1.0), terms)

    # ------------------------------------------------------------------------------------------
    # The step: the gradient pass, then the update on global arrays (`engine.apply`).
    def _step(self, state: TrainState, batch: Batch,
              accumulation: int | None) -> tuple[TrainState, dict[str, Any]]:
        uses_loss_scaling = self.layout.config.uses_loss_scaling
        scale = state.loss_scale.scale if uses_loss_scaling else jnp.float32(1)
        key_data = (None if state.rng is None else
                    jax.random.key_data(step_key(state.rng, state.step)))
        batch = in_sequence_layout(batch, self.layout.sequence)     # allgather: zigzag chunks
        loss, grads, model_state = proven_call(self._gradients(accumulation), (  # `consumption`
            self.layout.plan.compute_inputs(state.params), batch, scale, state.model_state,
            key_data), self.layout, batch_at=1)
        extra = dict(loss) if isinstance(loss, dict) else {"loss": loss}
        state, metrics = apply_gradients(self.layout, state, extra.pop("loss"), grads,
                                         model_state, scale,
                                         on_host=self.update_placement.on_host)
        return state, {**metrics, **extra}


__all__ = ["ZeroStep", "default_optimizer", "frozen_paths", "next_token_loss"]

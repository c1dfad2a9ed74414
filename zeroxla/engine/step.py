"""`make_step`: the ZeRO training step, one pure function compiled once.

    step = make_step(model, mesh, optimizer=optax.adamw(1e-3), config=ZeroConfig(stage=3))
    state = step.init()
    state, metrics = step(state, batch)

The whole step runs inside one `jax.shard_map` over the data axes ("node", "local"), so every
collective is explicit:

    for each micro-batch (gradient accumulation):
        forward + backward            stage 3: per-layer all_gather / re-gather / psum_scatter
    reduce gradients                  stage 0-1: psum; stage 2: psum_scatter; stage 3: psum of
                                      the replicated (persistent) leaves only
    unscale, overflow check (fp16), global norm, clipping
    optimizer update on the local partition (stage >= 1), all_gather the new parameters back
    (stage 1-2, and stage 3's persistent leaves); stage 3 keeps the rest partitioned

The optimizer runs on flat local partitions, so it must be elementwise (Adam, AdamW, SGD,
momentum, Lion, ... - every optax optimizer without per-tensor statistics); gradient clipping is
`ZeroConfig.gradient_clipping`, computed over all shards.

`trainable` (an nnx filter) chooses the parameters to train; the others are frozen: the loss is
differentiated only with respect to the trainable ones, and frozen leaves have no gradient, no
gradient collective, no optimizer state (`state.opt_state` covers `plan.trainable_leaves`) and
no update. At stage 3 they are still partitioned and gathered for compute; with
`ZeroConfig.quantized_nontrainable_weights` they are stored as int8/int4 codes, quantized once
by `init` (ZeRO++'s LoRA setting: a frozen base model at a quarter of the memory and traffic).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zeroxla.collectives import zero as collectives
from zeroxla.collectives.zero import ZeroCollectives
from zeroxla.engine.config import ZeroConfig
from zeroxla.engine.loss_scale import init_loss_scale, update_loss_scale
from zeroxla.engine.mesh import DATA_AXES, LOCAL_AXIS, check_mesh, data_size
from zeroxla.engine.model_def import ModelDef, path_str
from zeroxla.engine.plan import ShardingPlan, plan_for
from zeroxla.engine.state import TrainState
from zeroxla.engine.gather import zero3_module
from zeroxla.collectives.zeropp import ZeroPPCollectives

Batch = Mapping[str, jax.Array]
LossFn = Callable[[nnx.Module, Batch], jax.Array]
BATCH_KEYS = ("inputs", "targets")
Filter = Any          # anything `nnx.filterlib.to_predicate` accepts


def next_token_loss(model: nnx.Module, batch: Batch) -> jax.Array:
    """Mean cross-entropy of `model(batch['inputs'])` against `batch['targets']` over all tokens."""
    logits = model(batch["inputs"]).astype(jnp.float32)                    # [B, T, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))


def frozen_paths(model: nnx.Module, trainable: Filter | None) -> frozenset[str]:
    """Paths of the parameters of `model` (concrete or abstract) that the nnx filter
    `trainable` does not select; none when `trainable` is None (everything trains)."""
    if trainable is None:
        return frozenset()
    selects = nnx.filterlib.to_predicate(trainable)
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return frozenset(path_str(path) for path, variable in params if not selects(path, variable))


def default_optimizer() -> optax.GradientTransformation:
    """AdamW with DeepSpeed's default betas and eps."""
    return optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)


class ZeroStep:
    """A compiled ZeRO training step. Call it; `init`, `lower` and `eval_loss` are beside it."""

    def __init__(self, model: nnx.Module | Callable[[], nnx.Module], mesh: Mesh, *,
                 optimizer: optax.GradientTransformation | None = None,
                 config: ZeroConfig | None = None, loss_fn: LossFn | None = None,
                 trainable: Filter | None = None):
        check_mesh(mesh)
        self.mesh = mesh
        self.config = config = config if config is not None else ZeroConfig()
        self.data_size = data_size(mesh)
        config.validate_for_mesh(mesh.shape[LOCAL_AXIS], self.data_size)
        self.optimizer = optimizer if optimizer is not None else default_optimizer()
        self.loss_fn = loss_fn if loss_fn is not None else next_token_loss

        if isinstance(model, nnx.Module):
            self._factory = None
            self.model_def, values = ModelDef.of(model)
            self._initial_values = {p: jnp.asarray(v) for p, v in values.items()}
            frozen = frozen_paths(model, trainable)
        elif callable(model):
            self._factory = model
            abstract = nnx.eval_shape(model)
            self.model_def, _ = ModelDef.of(abstract)
            self._initial_values = None
            frozen = frozen_paths(abstract, trainable)
        else:
            raise TypeError(f"make_step: model must be an nnx.Module or a factory returning one, "
                            f"got {type(model).__name__}")
        if len(frozen) == len(self.model_def.paths):
            raise ValueError(f"make_step: trainable={trainable!r} selects none of the model's "
                             f"parameters {list(self.model_def.paths[:5])}...; pass a filter "
                             "that selects at least one (None trains all)")
        self.trainable = trainable

        self.plan: ShardingPlan = plan_for(self.model_def, config, data_size=self.data_size,
                                           frozen=frozen)
        self.comm = (ZeroPPCollectives.from_config(config) if config.uses_zeropp
                     else ZeroCollectives(config.dtype))
        self.state_shardings = self._state_shardings()
        self.batch_sharding = NamedSharding(mesh, P(DATA_AXES))
        state_specs = jax.tree.map(lambda s: s.spec, self.state_shardings)
        batch_specs = P(DATA_AXES)            # every batch array: dim 0 over all data devices
        self._jitted = jax.jit(
            jax.shard_map(self._local_step, mesh=mesh, in_specs=(state_specs, batch_specs),
                          out_specs=(state_specs, P()), check_vma=False),
            donate_argnums=0)
        self._jitted_init = jax.jit(self._init_state, out_shardings=self.state_shardings)
        self._compiled: dict[Any, Any] = {}       # `compile`'s cache, by argument signature
        self._jitted_eval = jax.jit(
            jax.shard_map(self._local_eval, mesh=mesh, in_specs=(state_specs, batch_specs),
                          out_specs=P(), check_vma=False))

    # ------------------------------------------------------------------------------------------
    # Public surface.
    def init(self) -> TrainState:
        """The initial state, built directly in its sharded layout (like DeepSpeed's zero.Init:
        with a model factory, no device ever holds the full model)."""
        return self._jitted_init(self._initial_values)

    def lower_init(self) -> Any:
        """`jax.stages.Lowered` of `init`, e.g. for the memory analysis of its compiled program."""
        return self._jitted_init.lower(self._initial_values)

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
        """Mean loss over the global batch, no update."""
        return self._jitted_eval(state, self._check_batch(batch, accumulation=1))

    def describe_collectives(self) -> list[tuple[str, str, str, str]]:
        """(path, forward gather, backward gather, gradient reduction) per partitioned leaf."""
        return [(leaf.path, *self.comm.describe(leaf)) for leaf in self.plan.leaves
                if leaf.params_partitioned]

    # ------------------------------------------------------------------------------------------
    # Layouts.
    def _optimizer_view_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        return {leaf.path: jax.ShapeDtypeStruct(leaf.optimizer_shape, jnp.float32)
                for leaf in self.plan.trainable_leaves}

    def _state_shardings(self) -> TrainState:
        def named(spec):
            return NamedSharding(self.mesh, spec)
        replicated = named(P())
        view_shardings = {leaf.path: named(leaf.optimizer_spec)
                          for leaf in self.plan.trainable_leaves}
        abstract_opt = jax.eval_shape(self.optimizer.init, self._optimizer_view_shapes())
        opt_shardings = optax.tree_map_params(
            self.optimizer, lambda _, sharding: sharding, abstract_opt, view_shardings,
            transform_non_params=lambda _: replicated)
        loss_scale = (jax.tree.map(lambda _: replicated, init_loss_scale(self.config))
                      if self.config.uses_loss_scaling else None)
        # A leaf stored as codes has a `QuantizedArray` of specs (codes and scales).
        params = {leaf.path: jax.tree.map(named, leaf.param_spec) for leaf in self.plan.leaves}
        return TrainState(step=replicated, params=params,
                          opt_state=opt_shardings, loss_scale=loss_scale, plan=self.plan,
                          model_def=self.model_def)

    def _init_state(self, values: dict[str, jax.Array] | None) -> TrainState:
        if values is None:
            _, values = ModelDef.of(self._factory())
        params, view = {}, {}
        for leaf in self.plan.leaves:
            full = jnp.asarray(values[leaf.path], jnp.float32)
            params[leaf.path] = leaf.logical_to_storage(full)   # frozen codes: quantized once, here
            if leaf.trainable:
                view[leaf.path] = leaf.to_partitioned(full) if leaf.optimizer_partitioned else full
        return TrainState(
            step=jnp.int32(0), params=params, opt_state=self.optimizer.init(view),
            loss_scale=init_loss_scale(self.config) if self.config.uses_loss_scaling else None,
            plan=self.plan, model_def=self.model_def)

    def _check_batch(self, batch: Batch, accumulation: int | None = None) -> dict[str, Any]:
        """Validates the global batch; errors name the key, the shape and what is accepted.

        With the default loss the batch is `{"inputs": int32[B, T], "targets": int32[B, T]}`;
        with a custom `loss_fn` any dict of arrays sharing the leading batch dim B.
        """
        if not isinstance(batch, Mapping) or not batch:
            raise ValueError(f"batch must be a non-empty dict of arrays, got {type(batch).__name__}")
        if self.loss_fn is next_token_loss:
            if set(batch) != set(BATCH_KEYS):
                raise ValueError(f"batch must have exactly the keys {list(BATCH_KEYS)}, "
                                 f"got {sorted(batch)}")
            for key in BATCH_KEYS:
                shape, dtype = np.shape(batch[key]), np.asarray(batch[key]).dtype \
                    if not hasattr(batch[key], "dtype") else batch[key].dtype
                if len(shape) != 2:
                    raise ValueError(f"batch[{key!r}] has shape {shape}; expected int32[B, T]")
                if not jnp.issubdtype(dtype, jnp.integer):
                    raise ValueError(f"batch[{key!r}] has dtype {dtype}; expected int32[B, T]")
            if np.shape(batch["inputs"]) != np.shape(batch["targets"]):
                raise ValueError(f"batch['inputs'] {np.shape(batch['inputs'])} and "
                                 f"batch['targets'] {np.shape(batch['targets'])} differ in shape")
        leading = {key: (np.shape(value)[:1] or (None,))[0] for key, value in batch.items()}
        if len(set(leading.values())) != 1 or None in leading.values():
            raise ValueError(f"every batch array needs the same leading batch dim B; got {leading}")
        k = self.config.gradient_accumulation_steps if accumulation is None else accumulation
        multiple = self.data_size * k
        b = next(iter(leading.values()))
        if b % multiple:
            raise ValueError(
                f"batch size B={b} is not divisible by data-parallel size {self.data_size} x "
                f"gradient_accumulation_steps {k} = {multiple}; accepted: multiples of {multiple}")
        return dict(batch)

    # ------------------------------------------------------------------------------------------
    # Inside shard_map: everything below sees one device's local arrays.
    def _local_model(self, params: dict[str, jax.Array]) -> Any:
        dtype = self.config.dtype
        if self.config.stage < 3:
            return self.model_def.module({p: v.astype(dtype) for p, v in params.items()})
        values = {leaf.path: params[leaf.path] if leaf.params_partitioned
                  else params[leaf.path].astype(dtype) for leaf in self.plan.leaves}
        return zero3_module(self.model_def.module(values), self.plan, self.comm,
                            self.config.prefetch)

    def _gradients(self, params: dict[str, Any], batch: Batch,
                   scale: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Local loss contribution and gradients (scaled by `scale`) of the trainable leaves,
        summed over micro-batches.

        Each micro-batch's loss is divided by (devices x micro-batches), so the sum over all
        devices and micro-batches is the mean over the global batch. Frozen leaves enter the
        loss as constants: nothing is differentiated with respect to them.
        """
        k = self.config.gradient_accumulation_steps
        denominator = self.data_size * k
        trainable = {leaf.path: params[leaf.path] for leaf in self.plan.trainable_leaves}
        frozen = {p: v for p, v in params.items() if p not in trainable}

        def objective(p, micro):
            loss = self.loss_fn(self._local_model({**frozen, **p}), micro) / denominator
            return loss * scale, loss

        grad_fn = jax.grad(objective, has_aux=True)
        if k == 1:
            grads, loss = grad_fn(trainable, batch)
            return loss, jax.tree.map(lambda g: g.astype(jnp.float32), grads)

        micro_batches = jax.tree.map(lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:]), batch)

        def accumulate(carry, micro):
            loss_sum, grad_sum = carry
            grads, loss = grad_fn(trainable, micro)
            return (loss_sum + loss,
                    jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum, grads)), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable)
        (loss, grads), _ = lax.scan(accumulate, (jnp.float32(0), zeros), micro_batches)
        return loss, grads

    def _reduce(self, grads: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], set[str]]:
        """Sums the trainable leaves' gradients over the data devices; returns them and the
        paths left sharded."""
        stage = self.config.stage
        leaves = self.plan.trainable_leaves
        if stage <= 1:
            return collectives.all_reduce(grads), set()
        if stage == 2:
            return ({leaf.path: collectives.scatter_full_gradient(grads[leaf.path], leaf)
                     for leaf in leaves}, {leaf.path for leaf in leaves})
        sharded = {leaf.path for leaf in leaves if leaf.params_partitioned}
        replicated = collectives.all_reduce({p: g for p, g in grads.items() if p not in sharded})
        return {p: replicated.get(p, g) for p, g in grads.items()}, sharded

    def _local_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        cfg = self.config
        scale = state.loss_scale.scale if cfg.uses_loss_scaling else jnp.float32(1)
        loss, grads = self._gradients(state.params, batch, scale)
        grads, sharded = self._reduce(grads)
        grads = jax.tree.map(lambda g: g / scale, grads)

        # Global statistics: sharded leaves hold disjoint pieces (summed over devices), the
        # replicated ones are already whole (counted once).
        def sum_over(fn, keep):
            return sum((fn(g) for p, g in grads.items() if keep(p)), jnp.float32(0))
        sq = lax.psum(sum_over(lambda g: jnp.sum(jnp.square(g)), lambda p: p in sharded),
                      DATA_AXES) + sum_over(lambda g: jnp.sum(jnp.square(g)),
                                            lambda p: p not in sharded)
        grad_norm = jnp.sqrt(sq)
        if cfg.gradient_clipping > 0:
            # DeepSpeed's clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied when < 1.
            coef = jnp.minimum(cfg.gradient_clipping / (grad_norm + 1e-6), 1.0)
            grads = jax.tree.map(lambda g: g * coef, grads)

        new_params, new_opt_state = self._apply_optimizer(state.params, state.opt_state, grads,
                                                          sharded)
        metrics = {"loss": lax.psum(loss, DATA_AXES), "grad_norm": grad_norm}
        loss_scale = state.loss_scale
        if cfg.uses_loss_scaling:
            nonfinite = sum_over(lambda g: jnp.sum(~jnp.isfinite(g)), lambda p: True)
            overflow = lax.psum(nonfinite, DATA_AXES) > 0
            # An overflow skips the update: parameters and optimizer state stay bit-identical.
            new_params, new_opt_state = jax.tree.map(
                lambda new, old: jnp.where(overflow, old, new),
                (new_params, new_opt_state), (state.params, state.opt_state))
            loss_scale = update_loss_scale(state.loss_scale, overflow, cfg)
            metrics.update(loss_scale=state.loss_scale.scale, overflow=overflow)
        new_state = state.replace(step=state.step + 1, params=new_params,
                                  opt_state=new_opt_state, loss_scale=loss_scale)
        return new_state, metrics

    def _apply_optimizer(self, params, opt_state, grads, sharded):
        """The optimizer on each trainable leaf's optimizer view (its local partition at stage
        >= 1); frozen leaves come back as they are."""
        param_view, grad_view = {}, {}
        for leaf in self.plan.trainable_leaves:
            p, g = params[leaf.path], grads[leaf.path]
            if leaf.optimizer_partitioned and not leaf.params_partitioned:
                p = collectives.local_partition(p, leaf)
                if leaf.path not in sharded:
                    g = collectives.local_partition(g, leaf)
            param_view[leaf.path], grad_view[leaf.path] = p, g
        updates, new_opt_state = self.optimizer.update(grad_view, opt_state, param_view)
        new_view = optax.apply_updates(param_view, updates)
        new_params = dict(params)
        for leaf in self.plan.trainable_leaves:
            new = new_view[leaf.path]
            new_params[leaf.path] = (collectives.gather_partition(new, leaf)
                                     if leaf.optimizer_partitioned and not leaf.params_partitioned
                                     else new)
        return new_params, new_opt_state

    def _local_eval(self, state: TrainState, batch: Batch) -> jax.Array:
        loss = self.loss_fn(self._local_model(state.params), batch) / self.data_size
        return lax.psum(loss, DATA_AXES)


def make_step(model: nnx.Module | Callable[[], nnx.Module], mesh: Mesh, *,
              optimizer: optax.GradientTransformation | None = None,
              config: ZeroConfig | None = None, loss_fn: LossFn | None = None,
              trainable: Filter | None = None) -> ZeroStep:
    """Builds the ZeRO training step for `model` on `mesh` (see the module docstring).

    `model` is an `nnx.Module` (its current parameters become the initial state) or a zero-arg
    factory (the state is then created directly in sharded form). `loss_fn(model, batch)`
    returns the mean loss over the batch it is given; the default is next-token cross-entropy.
    `trainable` is an nnx filter (a Variable type, `nnx.PathContains("lora")`, a
    `(path, variable) -> bool` callable, `nnx.Not(...)`, ...) choosing the parameters to train;
    None trains all. The rest are frozen.
    """
    return ZeroStep(model, mesh, optimizer=optimizer, config=config, loss_fn=loss_fn,
                    trainable=trainable)

"""DPO training on zeroxla: the policy is a ZeRO `make_step` with the DPO `loss_fn`; the frozen
starting model (a copy of the policy's first partitions, read in its layout) gives every pair's
reference log-prob sums once, before the first step, and is then dropped.

    DPOTrainer(config, policy, mesh=..., train=pair rows, val=pair rows)
      .step_record(k)   one optimizer step on step k's pairs: {"step", "loss", "accuracy",
                        "margin"} (accuracy and margin of the policy that step started from,
                        as TRL logs them)
      .evaluate()       {"val_loss", "val_accuracy", "val_margin"} on the held-out pairs
    run_dpo(...)        the loop, for notebooks: records of every step and evaluation

Accuracy and margin are read with forward-only programs of the same ZeRO layout
(`make_dpo_statistic` through `eval_loss`), so no step ever gathers the whole policy.

With an enabled `lora` (`zeroxla.lora.LoRAConfig`) the policy gets adapters on the weights its
`module_name` matches (B zero: step 0 is still the reference, loss log 2); the reference is the
plain starting model, and with `only_optimize_lora` the adapters alone train.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zeroxla
from zeroxla.engine.loss import check_packable, takes_packed_batches
from zeroxla.engine.sequence import packed_row_length
from zeroxla.engine.token_forward import TokenForward, fill_rows
from zeroxla.lora import LoRAConfig
from zeroxla.rlhf.answer_forward import reference_partitions
from zeroxla.rlhf.dpo.losses import (MASK_KEYS, REFERENCE_KEYS, TOKEN_KEYS, DPOConfig,
                                     make_dpo_loss, make_dpo_statistic)
from zeroxla.rlhf.packed_pairs import PAIR_VALUES, pack_pairs
from zeroxla.rlhf.answer_values import packed_logprobs, token_logprob_rows
from zeroxla.rlhf.roles import build_roles

STATISTICS = ("accuracy", "margin")


def _rows(arrays: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    return {key: value[rows] for key, value in arrays.items()}


PACKED_INPUTS = ("inputs", "targets", "positions", "segment_ids")


def _padded_token_logprobs(model: nnx.Module, batch: dict[str, jax.Array], *,
                           experts: Any = None) -> jax.Array:
    """`token_logprob_rows` [B, T-1] of padded pair rows {"tokens" int32[B, T]}: the
    `TokenForward` form."""
    return token_logprob_rows(model, batch["tokens"], experts)


def _per_device_bytes(tree: Any) -> dict[Any, int]:
    """{device: bytes of `tree`'s shards it holds}."""
    held: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def epoch_order(n: int, batch_size: int, k: int, seed: int) -> np.ndarray:
    """Step k's `batch_size` row indices of N: the rows in a fresh seeded shuffle each epoch
    (a batch may run on into the next), so step k's pairs depend on (seed, k) alone and a
    resumed run sees the pairs the uninterrupted one would."""
    epoch, offset = divmod(k * batch_size, n)
    epochs = range(epoch, epoch + -(-(offset + batch_size) // n))
    order = np.concatenate([np.random.default_rng((seed, e)).permutation(n) for e in epochs])
    return order[offset:offset + batch_size]


def check_policy(policy: nnx.Module, seq_len: int) -> None:
    """TypeError naming what `policy(tokens int32[B, T]) -> logits [B, T, V]` returned instead,
    checked abstractly (no compute) at T = seq_len - 1, the length the loss feeds it."""
    graphdef, state = nnx.split(policy)
    tokens = jax.ShapeDtypeStruct((2, seq_len - 1), jnp.int32)
    try:
        out = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)
    except Exception as err:                       # the user's __call__ refused the tokens
        raise TypeError(f"policy={type(policy).__name__} cannot be called on tokens int32[2, "
                        f"{seq_len - 1}]: {err}; accepted: a causal LM with model(tokens "
                        "int32[B, T]) -> logits [B, T, V]") from err
    shape = getattr(out, "shape", None)
    if (shape is None or len(shape) != 3 or tuple(shape[:2]) != (2, seq_len - 1)
            or not jnp.issubdtype(out.dtype, jnp.floating)):
        raise TypeError(f"policy={type(policy).__name__}(tokens int32[2, {seq_len - 1}]) returned "
                        f"{type(out).__name__} {shape}; accepted: logits [B, T, V], floating")


class DPOTrainer:
    """The policy's ZeRO step, its state and the pairs with their reference sums.

    `policy`: a plain model (`models.GPT`, `models.Llama`: `model(tokens) -> logits`), the
    start of training and the reference. `train`, `val`: `dpo.pair_batch` rows. `zero_config`:
    default ZeRO-3. `trainable`: `make_step`'s filter of the parameters to train (None: all;
    with `lora.only_optimize_lora`, the adapters). `lora`: adapters on the policy (a copy; the
    caller's `policy` stays plain), their A drawn from `seed`.
    To continue a run, assign a restored TrainState of `step`'s layout to `state`: the
    reference stays `policy`, the run's starting model."""

    def __init__(self, config: DPOConfig, policy: nnx.Module, *, mesh: Any,
                 train: dict[str, np.ndarray], val: dict[str, np.ndarray],
                 zero_config: zeroxla.ZeroConfig | None = None, seed: int = 0,
                 trainable: Any = None, lora: LoRAConfig | None = None):
        if not isinstance(config, DPOConfig):
            raise TypeError(f"config must be a DPOConfig, got {type(config).__name__}")
        n = len(train["chosen"])
        if n < config.batch_size:
            raise ValueError(f"DPOConfig.batch_size={config.batch_size} exceeds the {n} training "
                             f"pairs; accepted: batch_size <= {n}")
        check_policy(policy, config.seq_len)
        if config.packing:
            check_packable(policy, "DPOConfig.packing", "policy")
        self.config, self.seed = config, seed
        self.optimizer = optax.adamw(config.learning_rate)
        roles = build_roles(policy, mesh, optimizer=self.optimizer, seed=seed, lora=lora,
                            trainable=trainable,
                            zero_config=zero_config or zeroxla.ZeroConfig(stage=3),
                            loss_fn=make_dpo_loss(config.beta, config.loss_type),
                            eval_loss_fns={name: make_dpo_statistic(name, config.beta)
                                           for name in STATISTICS})
        self.step, self.statistics, self.state = roles.step, roles.eval_steps, roles.state
        # The first state is the reference (LoRA's B = 0): its partitions, read in the
        # policy's layout, then dropped.
        reference = reference_partitions(self.step, self.state, int8=config.reference_int8,
                                         owner="DPOConfig")
        # The most bytes of the reference one device held (1/N of the model under ZeRO-3).
        self.reference_bytes = max(_per_device_bytes(reference.params).values(), default=0)
        packed = takes_packed_batches(policy) or self.step.layout.sequence is not None
        self.train = {**train, **self._reference_sums(train, reference, packed)}
        self.val = {**val, **self._reference_sums(val, reference, packed)}

    def _reference_sums(self, rows: dict[str, np.ndarray], reference: Any, packed: bool,
                        pairs_per_call: int = 64) -> dict[str, np.ndarray]:
        """{"ref_chosen", "ref_rejected"} float32[N] of pair rows under `reference` (the
        policy's first partitions), computed in the policy's layout (`TokenForward`: rows and
        tokens split as the step splits them), `pairs_per_call` at a time: `packed`, each
        sequence's answer log-probs summed by the pair each slot is of; else the padded rows'
        (a policy that takes no packed batch)."""
        if not packed:
            return self._padded_reference_sums(rows, reference, pairs_per_call)
        n = len(rows["chosen"])
        forward = TokenForward(reference.step, packed_logprobs)   # each slot's target's
        out = {key: np.zeros(n, np.float32) for key in REFERENCE_KEYS}
        for start in range(0, n, pairs_per_call):
            piece = {key: np.asarray(rows[key])[start:start + pairs_per_call]
                     for key in (*TOKEN_KEYS, *MASK_KEYS)}
            m = len(piece["chosen"])
            piece.update({key: np.zeros(m, np.float32) for key in PAIR_VALUES})
            packed_rows = self._packed(piece, source=True)
            values = np.asarray(forward(reference, {k: packed_rows[k] for k in PACKED_INPUTS}))
            source = packed_rows["source"].reshape(-1)
            for key, mask in zip(REFERENCE_KEYS, MASK_KEYS):
                sums = np.bincount(source, (values * packed_rows[mask]).reshape(-1), m + 1)
                out[key][start:start + m] = sums[1:]
        return out

    def _padded_reference_sums(self, rows: dict[str, np.ndarray], reference: Any,
                               rows_per_call: int) -> dict[str, np.ndarray]:
        """`_reference_sums` of the padded rows, `rows_per_call` (a multiple of the data
        replicas) at a time, the last call padded with copies of its last row."""
        unit = self.step.layout.data_size
        rows_per_call = -(-rows_per_call // unit) * unit
        forward = TokenForward(reference.step, _padded_token_logprobs)
        out = {}
        for key, mask_key, ref_key in zip(TOKEN_KEYS, MASK_KEYS, REFERENCE_KEYS):
            tokens = np.asarray(rows[key])
            sums = []
            for start in range(0, len(tokens), rows_per_call):
                piece = tokens[start:start + rows_per_call]
                full = fill_rows(piece, rows_per_call)
                sums.append(np.asarray(forward(reference, {"tokens": full}))[:len(piece)])
            mask = np.asarray(rows[mask_key], np.float32)                   # [N, T-1]
            out[ref_key] = np.sum(np.concatenate(sums) * mask, axis=-1).astype(np.float32)
        return out

    def _device_batch(self, rows: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        sharding = self.step.layout.batch_sharding
        return {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i])
                for k, v in rows.items()}

    def _packed(self, rows: dict[str, np.ndarray], source: bool = False
                ) -> dict[str, np.ndarray]:
        """`rows` packed with `config.packing` or `source` (`packed_pairs`: the same loss
        without the padding; `source`: each slot's pair marked) into rows of `seq_len` - 1
        slots (a multiple of the chunks sequence parallelism cuts a row into), else as they
        are."""
        if not (self.config.packing or source):
            return rows
        layout = self.step.layout
        return pack_pairs(rows, row_len=packed_row_length(self.config.seq_len - 1, layout.sequence),
                          data_size=layout.data_size, source=source)[0]

    def step_record(self, k: int) -> dict[str, float]:
        """Step k (0-based) on its `batch_size` pairs (packed with `config.packing`); returns
        the record of step k + 1."""
        rows = _rows(self.train, epoch_order(len(self.train["chosen"]), self.config.batch_size,
                                             k, self.seed))
        batch = self._device_batch(self._packed(rows))
        stats = {name: float(s.eval_loss(self.state, batch))
                 for name, s in self.statistics.items()}
        self.state, metrics = self.step(self.state, batch)
        return {"step": k + 1, "loss": float(metrics["loss"]), **stats}

    def evaluate(self) -> dict[str, float]:
        """Held-out `val_loss`, `val_accuracy`, `val_margin`: exact means over every val pair
        (the last batch padded with rows of weight 0; packed as the training pairs are)."""
        n = len(self.val["chosen"])
        unit = self.step.layout.data_size                 # every device gets the same rows
        size = -(-min(n, self.config.batch_size) // unit) * unit
        sums = dict.fromkeys(("val_loss", *(f"val_{s}" for s in STATISTICS)), 0.0)
        for start in range(0, n, size):
            rows = np.arange(start, start + size) % n
            piece = _rows(self.val, rows)
            piece["weight"] = (np.arange(start, start + size) < n).astype(np.float32)
            count = float(piece["weight"].sum())
            batch = self._device_batch(self._packed(piece))
            sums["val_loss"] += float(self.step.eval_loss(self.state, batch)) * count
            for name, s in self.statistics.items():
                sums[f"val_{name}"] += float(s.eval_loss(self.state, batch)) * count
        return {k: v / n for k, v in sums.items()}

    def policy_model(self) -> nnx.Module:
        """The current policy, gathered (a plain model with full weights)."""
        return zeroxla.gathered_model(self.state)


@dataclasses.dataclass
class DPORun:
    """What `run_dpo` returns: one record per step (evaluations merged into theirs, and a step
    0 record of the start's evaluation), and the trainer (its `state`, `step`)."""

    records: list[dict[str, float]]
    trainer: DPOTrainer


def run_dpo(config: DPOConfig, steps: int, policy: nnx.Module, *, mesh: Any,
            train: dict[str, np.ndarray], val: dict[str, np.ndarray], eval_every: int = 10,
            seed: int = 0, zero_config: zeroxla.ZeroConfig | None = None,
            lora: LoRAConfig | None = None,
            on_record: Callable[[dict[str, float]], None] | None = None) -> DPORun:
    """`steps` DPO steps from `policy` (see `DPOTrainer`; `lora`: adapters on the policy),
    evaluated on `val` before the first step, every `eval_every` steps and after the last."""
    for name, value in (("steps", steps), ("eval_every", eval_every)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid; accepted: an integer >= 1")
    trainer = DPOTrainer(config, policy, mesh=mesh, train=train, val=val, seed=seed,
                         zero_config=zero_config, lora=lora)
    records = [{"step": 0, **trainer.evaluate()}]
    if on_record is not None:
        on_record(records[0])
    for k in range(steps):
        record = trainer.step_record(k)
        if (k + 1) % eval_every == 0 or k + 1 == steps:
            record.update(trainer.evaluate())
        records.append(record)
        if on_record is not None:
            on_record(record)
    return DPORun(records, trainer)


__all__ = ["DPORun", "DPOTrainer", "STATISTICS", "check_policy", "epoch_order", "run_dpo"]

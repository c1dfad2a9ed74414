"""What `restore` reads into: the target ZeroStep, checked against the checkpoint.

The target is the caller's ZeroStep, or one made with `make_step` on the caller's mesh for the
model the checkpoint records (`model_record`), with the caller's optimizer. Before any array is
read, the target's logical shapes are compared with the stored ones; the first parameter (then
optimizer leaf, then step counter) that differs is named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jax.sharding import Mesh

from zeroxla import models
from zeroxla.checkpoint.listing import CheckpointInfo
from zeroxla.checkpoint.model_record import model_config_from_record
from zeroxla.engine.logical import LogicalLayout
from zeroxla.engine.step import ZeroStep
from zeroxla.make import make_step
from zeroxla.sharding.config import ZeroConfig


def target_step(target: Any, meta: Mapping[str, Any], optimizer: Any,
                loss_fn: Any) -> ZeroStep:
    """`restore`'s target as a ZeroStep: the caller's own, or one made on the given mesh for the
    model rebuilt from the checkpoint's metadata `meta`, with `optimizer` and `loss_fn`."""
    if isinstance(target, ZeroStep):
        if optimizer is not None or loss_fn is not None:
            raise ValueError("restore: optimizer/loss_fn are only used with a (mesh, config) "
                             "target; a ZeroStep already has them")
        return target
    if isinstance(target, Mesh):
        mesh, config = target, None
    elif isinstance(target, tuple) and len(target) == 2 and isinstance(target[0], Mesh):
        mesh, config = target
    else:
        raise TypeError(f"restore: target must be a ZeroStep, a Mesh or (mesh, ZeroConfig); "
                        f"got {type(target).__name__}")
    if optimizer is None:
        # An optax transformation is code (closures, schedules): the checkpoint holds its state
        # but cannot record it, and make_step's default AdamW(1e-3) would resume any other run
        # silently wrong (its moments read as Adam's, its learning rate replaced).
        raise ValueError(
            "restore: optimizer=None with a mesh target; pass optimizer=<the optax "
            "transformation the run trained with> (a checkpoint stores the optimizer's state, "
            "not the optimizer, so none is assumed), or restore into a ZeroStep built with it; "
            "for the weights alone use zeroxla.load_params(directory)")
    if config is None:
        known = {f.name for f in dataclasses.fields(ZeroConfig)}
        config = ZeroConfig(**{k: v for k, v in meta["zero_config"].items() if k in known})
    record = meta["model_config"]
    if record is None:
        raise ValueError("restore: the checkpoint records no model config; restore into a "
                         "ZeroStep built with the model")
    model_config = model_config_from_record(record)
    model_cls = models.model_class(model_config)

    def factory():
        from flax import nnx

        return model_cls(model_config, rngs=nnx.Rngs(0))

    return make_step(factory, mesh, optimizer=optimizer, config=config, loss_fn=loss_fn)


def check_compatible(meta: Mapping[str, Any], layout: LogicalLayout, info: CheckpointInfo) -> None:
    """Raises ValueError at the first parameter (then optimizer leaf) that differs."""
    # A frozen leaf saved as codes has the logical shape its layout record states.
    stored = {**meta["arrays"], **{f"params/{path}": {"shape": record["shape"]}
                                   for path, record in meta.get("frozen_codes", {}).items()}}
    record = meta.get("model_config")
    where = f"checkpoint step {info.step} at {info.path}"
    if record:
        fields = ", ".join(f"{k}={v}" for k, v in record["fields"].items())
        where += f" ({record['class']}({fields}))"

    def shape(name, table):
        if name not in table:
            return "absent"
        entry = table[name]
        return tuple(entry["shape"] if isinstance(entry, dict) else entry.shape)

    target = layout.abstract
    for prefix, what in (("params/", "parameter"), ("opt_state/", "optimizer state leaf"),
                         ("step", "step counter")):
        names = [n for n in target if n.startswith(prefix)]
        names += [n for n in stored if n.startswith(prefix) and n not in target]
        for name in names:
            ours, theirs = shape(name, target), shape(name, stored)
            if ours != theirs:
                label = name[len(prefix):] if prefix.endswith("/") else name
                hint = ("; restore with the optimizer the checkpoint was trained with"
                        if prefix == "opt_state/" else "")
                raise ValueError(f"{where} does not match the target: first mismatched {what} "
                                 f"{label!r}: checkpoint shape {theirs}, target shape {ours}"
                                 f"{hint}")


__all__ = ["check_compatible", "target_step"]

"""What makes a checkpoint trustworthy: array checksums and the digested JSON metadata.

Orbax does not verify what it reads back: a flipped byte in a data file is decompressed into
wrong values without an error. So every array's checksum (a position-weighted sum of its bits
mod 2**32, independent of the sharding) is stored in the JSON and verified after every restore
and export, and the JSON carries a SHA-256 digest of itself. The caller's metadata may hold
numpy/jax arrays and PRNG keys; they are encoded as tagged JSON objects.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zeroxla.checkpoint.listing import (
    FORMAT_VERSION,
    META_ITEM,
    READABLE_FORMATS,
    CheckpointError,
    CheckpointInfo,
    CorruptCheckpointError,
    select,
)

_CHECKSUM_MULTIPLIER = 0x9E3779B1   # odd: any change to one element changes the checksum
_CHECKSUM_BLOCK = 8192


def _u32_bits(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def checksum(x: jax.Array) -> jax.Array:
    """sum_i bits(x_i) * (i * K + 1) mod 2**32 over the row-major flat index i."""
    weights = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) * jnp.uint32(
        _CHECKSUM_MULTIPLIER) + jnp.uint32(1)
    return jnp.sum(_u32_bits(x) * weights, dtype=jnp.uint32)


def checksum_numpy(x: np.ndarray, offset: int = 0) -> int:
    """`_checksum`'s contribution of `x`, a block of a larger array starting at flat `offset`.

    Works through `x` in small blocks, so its scratch memory stays ~100 KiB at any size.
    """
    flat = np.ascontiguousarray(x).reshape(-1)
    if flat.dtype != np.bool_:
        flat = flat.view(f"uint{8 * flat.dtype.itemsize}")
    total = 0
    for start in range(0, flat.size, _CHECKSUM_BLOCK):
        bits = flat[start:start + _CHECKSUM_BLOCK].astype(np.uint32)
        index = np.arange(bits.size, dtype=np.uint32) + np.uint32((offset + start) & 0xFFFFFFFF)
        index *= np.uint32(_CHECKSUM_MULTIPLIER)
        index += np.uint32(1)
        bits *= index
        total = (total + int(np.sum(bits, dtype=np.uint32))) & 0xFFFFFFFF
    return total


def host_int(x: jax.Array) -> int:
    """A replicated scalar's value, also when the array spans several processes."""
    return int(np.asarray(x.addressable_data(0)))


def encode(obj: Any) -> Any:
    if isinstance(obj, jax.Array) and jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
        return {"__prng_key__": str(jax.random.key_impl(obj)),
                "data": np.asarray(jax.random.key_data(obj)).tolist()}
    if isinstance(obj, (np.ndarray, jax.Array)):
        array = np.asarray(obj)
        return {"__ndarray__": array.tolist(), "dtype": array.dtype.name}
    if isinstance(obj, np.generic):
        return obj.item()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise TypeError(f"checkpoint metadata must be JSON-serialisable (dicts, lists, numbers, "
                    f"strings, numpy/jax arrays, PRNG keys); got {type(obj).__name__}")


def decode(obj: dict[str, Any]) -> Any:
    if "__prng_key__" in obj:
        return jax.random.wrap_key_data(np.asarray(obj["data"], np.uint32),
                                        impl=obj["__prng_key__"])
    if "__ndarray__" in obj:
        return np.asarray(obj["__ndarray__"], dtype=obj["dtype"])
    return obj


def digest(meta: Mapping[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def read_metadata(directory: str | Path, step: int | None = None) -> dict[str, Any]:
    """The stored JSON of checkpoint `step` (default: newest complete), digest verified.

    Keys: format, step, zero_config, model_config, loss_scale, mesh, metadata (the caller's,
    decoded), arrays ({name: {shape, dtype, checksum}}), digest.
    """
    directory = Path(directory).absolute()
    return read_meta(select(directory, step))


def read_meta(info: CheckpointInfo) -> dict[str, Any]:
    path = info.path / META_ITEM / "metadata"
    try:
        text = path.read_text()
        meta = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpointError(f"checkpoint step {info.step}: cannot read {path}: "
                                     f"{err}") from err
    if not isinstance(meta, dict) or meta.get("digest") != digest(meta):
        raise CorruptCheckpointError(f"checkpoint step {info.step}: {path} fails its digest "
                                     "check (the file was modified or corrupted)")
    if meta.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"checkpoint step {info.step} has format {meta.get('format')!r}; "
                              f"this zeroxla writes format {FORMAT_VERSION} and reads formats "
                              f"{', '.join(map(str, READABLE_FORMATS))}")
    meta["metadata"] = json.loads(json.dumps(meta["metadata"]), object_hook=decode)
    return meta




@jax.jit
def checksums(arrays: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """`checksum` of every array of a flat dict, in one program."""
    return {name: checksum(x) for name, x in arrays.items()}

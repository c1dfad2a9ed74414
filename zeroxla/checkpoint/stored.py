"""Reading single arrays of a checkpoint as numpy, one tensor or one layer at a time (export).

A frozen leaf saved as codes (`zeroxla.checkpoint.codes`) reads as its float32 values, so
readers see every parameter at its logical shape whatever its storage."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from zeroxla.checkpoint import codes
from zeroxla.checkpoint.integrity import checksum_numpy, read_meta
from zeroxla.checkpoint.listing import STATE_ITEM, CorruptCheckpointError, select


class StoredArrays:
    """Reads arrays of one checkpoint as numpy, whole or one index of dim 0 at a time, straight
    from tensorstore (no devices). Checksums are verified once every index of an array has
    been read (or the whole array at once)."""

    def __init__(self, directory: str | Path, step: int | None = None):
        directory = Path(directory).absolute()
        self.info = select(directory, step)
        self.meta = read_meta(self.info)
        item = self.info.path / STATE_ITEM
        stored = json.loads((item / "_METADATA").read_text())
        self._use_ocdbt = stored.get("use_ocdbt", True)
        self._use_zarr3 = stored.get("use_zarr3", False)
        self._item = epath.Path(item)
        import tensorstore as ts

        self._ts = ts
        # B-tree nodes of the OCDBT index are cached (bounded); array data is not.
        self._context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 16 * 2**20}})
        self._stores: dict[str, Any] = {}                     # name -> opened TensorStore
        self._partial: dict[str, tuple[int, set[int]]] = {}   # name -> (checksum so far, indices)

    def shape(self, name: str) -> tuple[int, ...]:
        frozen = self._frozen(name)
        if frozen is not None:
            return frozen.shape
        return tuple(self.meta["arrays"][name]["shape"])

    def __contains__(self, name: str) -> bool:
        return name in self.meta["arrays"] or self._frozen(name) is not None

    def _frozen(self, name: str) -> codes.Stored | None:
        """The stored form of the codes when `name` is 'params/<path>' of a leaf saved as codes."""
        path = name[len("params/"):] if name.startswith("params/") else None
        record = self.meta.get("frozen_codes", {}).get(path)
        return None if record is None else codes.stored_layout(path, record)

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """Array `name` (e.g. 'params/embed/wte'), or its slice `[index]`. A frozen leaf saved
        as int8/int4 codes reads as its float32 values (code * step)."""
        frozen = self._frozen(name)
        if frozen is not None:
            data, scales = (self.read(codes.array_name(frozen.path, f), index)
                            for f in codes.FIELDS)
            return codes.dequantize_numpy(frozen, data, scales)
        try:
            store = self._open(name)
            # Copied into numpy-owned memory: tensorstore's buffer is freed at once, and the
            # array is visible to tracemalloc (tests/zeroxla/test_export.py bounds the peak).
            value = np.array((store if index is None else store[index]).read().result())
        except ValueError as err:
            raise CorruptCheckpointError(f"checkpoint step {self.info.step} at {self.info.path}:"
                                         f" cannot read {name!r}: {err}") from err
        self._account(name, value, index)
        return value

    def _open(self, name: str) -> Any:
        if name not in self.meta["arrays"]:
            raise KeyError(f"no array {name!r} in checkpoint step {self.info.step}")
        if name not in self._stores:
            spec = ocp.type_handlers.get_json_tspec_read(
                ocp.type_handlers.ParamInfo(name=name.replace("/", "."), parent_dir=self._item,
                                            use_zarr3=self._use_zarr3,
                                            ts_context=self._context),
                use_ocdbt=self._use_ocdbt)
            store = self._ts.open(spec, context=self._context, read=True).result()
            if tuple(store.shape) != self.shape(name):
                raise CorruptCheckpointError(
                    f"checkpoint step {self.info.step}: array {name!r} is stored with shape "
                    f"{tuple(store.shape)}, its metadata says {self.shape(name)}")
            self._stores[name] = store
        return self._stores[name]

    def _account(self, name: str, value: np.ndarray, index: int | None) -> None:
        shape = self.shape(name)
        if index is None:
            total, seen = checksum_numpy(value), set(range(shape[0] if shape else 1))
        else:
            block = math.prod(shape[1:])
            total, seen = self._partial.get(name, (0, set()))
            total = (total + checksum_numpy(value, offset=index * block)) & 0xFFFFFFFF
            seen = seen | {index}
        self._partial[name] = (total, seen)
        if len(seen) == (shape[0] if shape else 1):
            expected = self.meta["arrays"][name]["checksum"]
            if total != expected:
                raise CorruptCheckpointError(
                    f"checkpoint step {self.info.step} at {self.info.path} is corrupted: array "
                    f"{name!r} fails its checksum (stored {expected:#010x}, read {total:#010x})")

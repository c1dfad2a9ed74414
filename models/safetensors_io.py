"""safetensors files as Hugging Face writes and reads them: single or sharded with an index.

Reading yields one tensor at a time; writing keeps at most one shard's tensors in host memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

class SafetensorsReader:
    """`reader(name)` -> the whole tensor; `reader(name, index)` -> only `index` (a tuple of
    slices) of it, read from the file without the rest; `reader.shape(name)` -> its shape.
    Files open on first use and stay open until `open_safetensors` exits."""

    def __init__(self, path: Path, files: dict[str, Path] | None, single: Path | None,
                 stack: contextlib.ExitStack):
        self.path, self._files, self._single, self._stack = path, files, single, stack
        self._opened: dict[Path, tuple[Any, set[str]]] = {}   # file -> (handle, tensor names)

    def _handle(self, name: str) -> Any:
        f = self._single if self._files is None else self._files.get(name)
        if f is not None and f not in self._opened:
            handle = self._stack.enter_context(safe_open(str(f), framework="numpy"))
            self._opened[f] = handle, set(handle.keys())
        if f is None or name not in self._opened[f][1]:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.path}")
        return self._opened[f][0]

    def __call__(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        if index is None:
            return self._handle(name).get_tensor(name)
        return self._handle(name).get_slice(name)[index]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())


@contextlib.contextmanager
def open_safetensors(path: str | os.PathLike) -> Iterator[SafetensorsReader]:
    """Yields a `SafetensorsReader` over a HF checkpoint: a directory with `model.safetensors`
    or `model.safetensors.index.json` + shards, or one `.safetensors` file. Each call reads one
    tensor (or part of one); files stay open until the context exits."""
    path = Path(path)
    files, single = None, None
    if path.is_dir():
        index = path / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: path / f for name, f in weight_map.items()}
        elif (path / SINGLE_FILE).exists():
            single = path / SINGLE_FILE
        else:
            raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    else:
        single = path
    with contextlib.ExitStack() as stack:
        yield SafetensorsReader(path, files, single, stack)


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or "5GB" / "500MB" / "2GiB", read as transformers'
    `convert_file_size_to_int` reads `max_shard_size`: KB/MB/GB are powers of 10, KiB/MiB/GiB
    powers of 2, and a lower-case final "b" ("5Gb") means bits."""
    if isinstance(size, int):
        if size < 1:
            raise ValueError(f"max_shard_size={size} must be >= 1 byte")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?(B)\s*", size, re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    unit = (m.group(2) or "").upper()
    binary = unit.endswith("I")
    scale = (1024 if binary else 1000) ** {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[:1]]
    bits = m.group(3) == "b" and not binary
    return int(float(m.group(1)) * scale) // (8 if bits else 1)


def _np_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _shard_name(n: int, total: int) -> str:
    return f"model-{n:05d}-of-{total:05d}.safetensors"


def write_safetensors(tensors: Iterable[tuple[str, Any]], out_dir: str | os.PathLike, *,
                      dtype: Any = "float32", max_shard_size: int | str = "5GB") -> list[Path]:
    """Writes `(name, array)` pairs as HF safetensors shards in `out_dir`; returns the files.

    One shard: `model.safetensors`. Several: `model-0000k-of-0000N.safetensors` plus
    `model.safetensors.index.json`, as `save_pretrained` writes them (a tensor larger than
    `max_shard_size` gets a shard of its own). A previous export's weight files in `out_dir` are
    removed. Arrays are cast to `dtype` (float32, bfloat16, float16) as they arrive.

    Host memory: the tensors of one shard (<= max(max_shard_size, largest tensor)), plus the
    tensor being produced and its source before the cast. safetensors writes a shard from the
    arrays' buffers without copying them.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    limit, target = parse_size(max_shard_size), _np_dtype(dtype)
    for old in out_dir.iterdir():
        if old.name in (SINGLE_FILE, INDEX_FILE) or re.fullmatch(
                r"model-\d{5}(-of-\d{5})?\.safetensors(\.part)?", old.name):
            old.unlink()

    parts: list[Path] = []
    weight_map: dict[str, int] = {}      # HF name -> shard number (1-based)
    shard: dict[str, np.ndarray] = {}
    shard_bytes = total_bytes = 0

    def flush():
        nonlocal shard, shard_bytes
        part = out_dir / f"model-{len(parts) + 1:05d}.safetensors.part"   # renamed at the end
        save_file(shard, str(part), metadata={"format": "pt"})
        parts.append(part)
        shard, shard_bytes = {}, 0

    for name, array in tensors:
        if name in weight_map:
            raise ValueError(f"tensor {name!r} is written twice")
        array = np.ascontiguousarray(np.asarray(array).astype(target, copy=False))
        if shard and shard_bytes + array.nbytes > limit:
            flush()
        shard[name] = array
        shard_bytes += array.nbytes
        total_bytes += array.nbytes
        weight_map[name] = len(parts) + 1
    if shard or not parts:
        flush()

    if len(parts) == 1:
        return [parts[0].rename(out_dir / SINGLE_FILE)]
    final = [p.rename(out_dir / _shard_name(n, len(parts))) for n, p in enumerate(parts, 1)]
    index = {"metadata": {"total_size": total_bytes},
             "weight_map": {k: _shard_name(n, len(parts)) for k, n in sorted(weight_map.items())}}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return final + [out_dir / INDEX_FILE]

"""Export: a checkpoint's consolidated weights as Hugging Face safetensors.

    zeroxla export CHECKPOINT OUT [--dtype float32|bfloat16] [--max-shard-size 5GB] [--step N]
    export_checkpoint("runs/ckpt", "hf_out", dtype="bfloat16")
    checkpoint_metadata("runs/ckpt")["metadata"]      # what the trainer stored beside it

DeepSpeed's `zero_to_fp32.py` first loads every rank's partition into host memory. Here a
checkpoint already stores every parameter whole in its logical shape (`zeroxla.checkpoint`), so
the export streams: for each Hugging Face tensor it reads just the parameter slices that make it
(one layer of a stacked `[L, ...]` leaf), straight from tensorstore with no devices, converts
them (`models.hf` owns the name map and the reshapes), and hands the tensor to the safetensors
writer, which keeps at most one shard. Host memory stays at about one shard plus a few copies of
the largest tensor, whatever the model size. Every array's checksum is verified as it is read.

The `zeroxla export` subcommand is declared in `zeroxla.app.cli`; it also writes the tokenizer a
`zeroxla train` checkpoint records (`zeroxla.app.hf_tokenizer`), so that
`transformers.AutoTokenizer.from_pretrained(OUT)` loads next to the model. Every file written is
mode 0644.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16")
FILE_MODE = 0o644


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, step: int | None = None,
                      dtype: str = "float32", max_shard_size: int | str = "5GB") -> list[Path]:
    """Writes checkpoint `step` (default: the newest complete one) as a HF model in `out_dir`.

    `checkpoint` is a checkpoint directory (the one given to `zeroxla.save`) or one step
    directory inside it. Writes `config.json` and `model.safetensors` (or numbered shards of at
    most `max_shard_size` plus `model.safetensors.index.json`), with GPT-2 / Llama parameter
    names; returns the files written. Raises ValueError when the checkpoint records no model
    config of a known family, CorruptCheckpointError when an array fails its checksum.
    """
    from zeroxla.models import hf
    from zeroxla import checkpoint as ckpt

    if dtype not in DTYPES:
        raise ValueError(f"export: dtype={dtype!r} is invalid; accepted: {', '.join(DTYPES)}")
    root, step = _resolve(Path(checkpoint), step)
    arrays = ckpt.StoredArrays(root, step)
    record = arrays.meta["model_config"]
    if record is None:
        raise ValueError(f"checkpoint {arrays.info.path} records no model config; export needs "
                         "the model family and shape (save with model_config=...)")
    config = ckpt.model_config_from_record(record)

    def get(path: str, layer: int | None) -> Any:
        return arrays.read(f"params/{path}", layer)

    files = hf.save_hf_model(config, get, out_dir, dtype=dtype, max_shard_size=max_shard_size)
    # safetensors creates its files owner-only (0600); an export is meant to be shared and
    # uploaded, so every file is world-readable whatever the umask.
    for path in files:
        path.chmod(FILE_MODE)
    return files


def checkpoint_metadata(checkpoint: str | Path, *, step: int | None = None) -> dict[str, Any]:
    """The stored JSON of the checkpoint `export_checkpoint(checkpoint, step=step)` would read
    (`zeroxla.checkpoint.read_metadata`): its "step", "model_config" and the caller's
    "metadata", e.g. the tokenizer `zeroxla train` records."""
    from zeroxla import checkpoint as ckpt

    root, step = _resolve(Path(checkpoint), step)
    return ckpt.read_metadata(root, step)


def _resolve(path: Path, step: int | None) -> tuple[Path, int | None]:
    """A step directory `DIR/<n>` -> (DIR, n); a checkpoint directory -> (it, step)."""
    from zeroxla import checkpoint as ckpt

    if not path.exists():
        raise FileNotFoundError(f"export: no checkpoint at {path}")
    if (path / ckpt.META_ITEM).is_dir() and path.name.isdigit():
        if step is not None and step != int(path.name):
            raise ValueError(f"export: {path} is step {path.name}, but step={step} was asked for")
        return path.parent, int(path.name)
    return path, step


__all__ = ["DTYPES", "FILE_MODE", "checkpoint_metadata", "export_checkpoint"]

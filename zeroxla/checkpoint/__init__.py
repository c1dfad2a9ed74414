"""Checkpoints: sharded, layout-independent save and restore on orbax; safetensors export.

    listing.py     a directory's steps (complete or interrupted), which one to read
    integrity.py   array checksums, the digested JSON metadata
    manager.py     save / Checkpointer / restore
    target.py      what restore reads into: the target ZeroStep, checked against the stored shapes
    model_record.py  the model config a checkpoint records, and back
    codes.py       frozen int8/int4 leaves saved as codes, in logical groups: exact on any mesh
    stored.py      one array (or one layer of it) as numpy, without devices
    retention.py   keep_last: deleting older step checkpoints once a newer one is committed
    weights.py     load_params: a checkpoint's model and trained parameters, no optimizer
    export.py      a checkpoint's weights as Hugging Face safetensors, streamed
    adapters.py    a LoRA model's checkpoint read merged (W + (alpha / r) A @ B) for export
    pretrained.py  load_pretrained: a Hugging Face checkpoint straight into ZeRO partitions
"""

from zeroxla.checkpoint.integrity import checksum_numpy, read_metadata
from zeroxla.checkpoint.listing import (
    COMMIT_FILE,
    META_ITEM,
    STATE_ITEM,
    TMP_SUFFIX,
    CheckpointError,
    CheckpointInfo,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    IncompleteCheckpointWarning,
    latest_step,
    list_checkpoints,
)
from zeroxla.checkpoint.manager import Checkpointer, Restored, model_config_from_record, restore, save
from zeroxla.checkpoint.stored import StoredArrays
from zeroxla.checkpoint.weights import load_params
from zeroxla.engine.logical import logical_sharding

__all__ = ["COMMIT_FILE", "META_ITEM", "STATE_ITEM", "TMP_SUFFIX", "CheckpointError",
           "CheckpointInfo", "Checkpointer", "CorruptCheckpointError", "IncompleteCheckpointError",
           "IncompleteCheckpointWarning", "Restored", "StoredArrays", "checksum_numpy", "load_params",
           "latest_step", "list_checkpoints", "logical_sharding", "model_config_from_record",
           "read_metadata", "restore", "save"]

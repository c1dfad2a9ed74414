"""W&B's offline run file (`wandb/offline-run-*/run-<id>.wandb`) read back as its records.

The file is what `wandb sync` uploads: a 7-byte header (":W&B", magic 0xBEE1, version 0), then
LevelDB's log format in 32 KiB blocks (each chunk: CRC-32 of its type byte and data, length,
type FULL / FIRST / MIDDLE / LAST), each record a `wandb_internal_pb2.Record`. The wandb
package no longer ships a Python reader, so the tests read it here, with wandb's own protobuf
message; every chunk's CRC is checked.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<4sHB")          # ":W&B", 0xBEE1, version
CHUNK = struct.Struct("<IHB")            # crc32, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: str | Path) -> list[bytes]:
    """The serialized records of a .wandb file, in order."""
    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    records, pending, at = [], b"", HEADER.size
    while at + CHUNK.size <= len(data):
        if BLOCK - at % BLOCK < CHUNK.size:           # a block's tail too short for a chunk
            at += BLOCK - at % BLOCK
            continue
        crc, length, kind = CHUNK.unpack_from(data, at)
        body = data[at + CHUNK.size:at + CHUNK.size + length]
        if kind == 0 and length == 0:                  # zero padding at the end
            break
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, at
        at += CHUNK.size + length
        if kind == FULL:
            records.append(body)
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            records.append(pending + body)
    return records


def offline_run(run_dir: str | Path) -> dict[str, Any]:
    """{"history": [{"_step": n, key: value, ...}], "config": {...}, "summary": {...}} of the
    one offline W&B run under `run_dir`/wandb/."""
    from wandb.proto import wandb_internal_pb2

    files = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history, config, summary = [], {}, {}
    for raw in raw_records(files[0]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json)
                           for item in record.config.update})
        elif kind == "summary":
            summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.summary.update})
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json)
                           for item in record.run.config.update})
    return {"history": history, "config": config, "summary": summary}

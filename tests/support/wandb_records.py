"""Reads an offline W&B run's ``.wandb`` file back: its history rows and config, as wandb recorded them.

wandb 0.31 ships no Python reader of its own for this file (the one it had, ``wandb.sdk.internal.datastore``, went
with the Go core), so this follows its documented layout: a 7-byte header (``:W&B``, magic 0xBEE1, version 0),
then LevelDB log blocks of 32 KiB whose chunks (CRC-32C, length, type FULL/FIRST/MIDDLE/LAST) carry serialized
``wandb_internal_pb2.Record`` messages, decoded here with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = struct.Struct("<4sHB")  # ident, magic, version
CHUNK = struct.Struct("<IHB")  # crc32c, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every ``Record`` in a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path} is not a W&B transaction log"
    out, pending, pos = [], b"", HEADER.size
    while pos + CHUNK.size <= len(data):
        room = BLOCK - pos % BLOCK
        if room < CHUNK.size:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero padding at the end of the file
            break
        body = data[pos + CHUNK.size:pos + CHUNK.size + length]
        pos += CHUNK.size + length
        pending = body if kind in (FULL, FIRST) else pending + body
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: Path) -> list[dict]:
    """The rows ``run.log`` wrote, each ``{key: value}`` with ``_step``."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def config(path: Path) -> dict:
    """The run's config as updated over the run (``run.config.update``)."""
    out = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind in ("config", "run"):  # `wandb.init(config=...)` lands in the run record, later updates apart
            update = record.config.update if kind == "config" else record.run.config.update
            out.update({item.key: json.loads(item.value_json) for item in update})
    return out


def run_file(out_dir: Path) -> Path:
    """The one offline run's ``.wandb`` file under ``out_dir/wandb``."""
    (found,) = sorted(Path(out_dir).glob("wandb/offline-run-*/run-*.wandb"))
    return found

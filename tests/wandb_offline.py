"""What a W&B offline run recorded, read from its record log with wandb's own message types (what `wandb sync`
uploads): the tests' check that every step reached the file."""

from __future__ import annotations

import glob
import json
import os
import struct


def wandb_offline_history(wandb_dir: str, metric: str) -> dict[int, float]:
    """{step: value of ``metric``} of the one offline run under ``wandb_dir`` (a run's reports/wandb)."""
    (offline_run,) = glob.glob(os.path.join(wandb_dir, "offline-run-*"))
    (log_file,) = glob.glob(os.path.join(offline_run, "*.wandb"))
    history = [record.history for record in _wandb_records(log_file) if record.WhichOneof("record_type") == "history"]
    return {json.loads(_item(h, "_step")): json.loads(_item(h, metric)) for h in history}


def _item(history, key: str) -> str:
    return next(item.value_json for item in history.item if (item.key or "/".join(item.nested_key)) == key)


def _wandb_records(path: str) -> list:
    """The protobuf Records of a W&B offline run file (what `wandb sync` uploads), read with wandb's own message
    types: the file is a LevelDB-style log (a 7-byte ":W&B" header, then 32 KiB blocks of records, each with a
    7-byte header: crc32, length, kind FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    position, chunks, pending = 7, [], b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:  # block trailer: too short for a header
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            chunks.append(pending + chunk)
    records = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records

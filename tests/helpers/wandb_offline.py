"""wandb's offline runs read back: the ``.wandb`` file of each ``offline-run-*`` folder (W&B's
LevelDB-style record log of protobufs), its run record (id, project, name) and history by step."""

from __future__ import annotations

import struct
from pathlib import Path


def read_wandb_records(path: Path):
    """Protobuf records of an offline ``run-<id>.wandb`` file: a 7-byte file header (``:W&B``, magic
    0xBEE1, version), then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type:
    1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path}: not a wandb run file"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_runs(wandb_dir: Path) -> list[dict]:
    """Each offline run under ``wandb_dir/wandb``, oldest first: ``id``, ``project``, ``name`` and
    ``history`` (step -> logged items, JSON-encoded values)."""
    runs = []
    for folder in sorted((Path(wandb_dir) / "wandb").glob("offline-run-*")):
        (run_file,) = folder.glob("run-*.wandb")
        info, history = None, {}
        for record in read_wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                info = record.run
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                history[int(items["_step"]) if "_step" in items else record.history.step.num] = items
        runs.append({"id": info.run_id, "project": info.project, "name": info.display_name, "history": history})
    return runs

"""An offline W&B run read back from its own files: `run-<id>.wandb` is a LevelDB-style log (a 7-byte header,
then 32 KiB blocks of records, each a 7-byte header: CRC-32C, length, kind) of W&B's protobuf `Record`s, parsed
here with W&B's own protobuf classes."""

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32 * 1024, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    chunks, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        body = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            chunks.append(body)
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            chunks.append(pending + body)
        elif kind == 0 and length == 0:  # zero padding to the block's end
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0
    return [pb.Record.FromString(c) for c in chunks]


def offline_run(folder: Path) -> dict:
    """An offline run folder's project, group, config, history (one dict per logged step), summary and exit code."""
    (path,) = folder.glob("run-*.wandb")
    run = {"history": [], "summary": {}, "config": {}, "exit_code": None}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(project=record.run.project, group=record.run.run_group, id=record.run.run_id)
            run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in record.history.item})
        elif kind == "summary":
            run["summary"].update({i.key: json.loads(i.value_json) for i in record.summary.update})
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run

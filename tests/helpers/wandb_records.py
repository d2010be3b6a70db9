"""Read the records of a wandb offline run file (`run-<id>.wandb`).

wandb 0.31 writes it from its Go core and ships no Python reader. The file is a 7-byte header (":W&B", magic
0xBEE1, version 0) followed by LevelDB-log framing: 32 KiB blocks of chunks (crc32c, length, type: 1 full,
2 first, 3 middle, 4 last) whose payloads are serialized `wandb_internal_pb2.Record` messages.
"""

import struct
import time
from pathlib import Path

BLOCK = 32768
HEADER = 7


def wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a wandb run file"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if pos + HEADER + length > len(data):  # a chunk still being written
            break
        chunk, pos = data[pos + HEADER : pos + HEADER + length], pos + HEADER + length
        if kind == 0:  # zero padding
            continue
        pending += chunk
        if kind in (1, 4):  # full, or the last of a split record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def run_end(run_dir: Path, wait_s: float = 30.0) -> tuple:
    """(exit code, whether the run was marked preempting) of the newest offline wandb run under run_dir.

    wandb's core writes the file in the background: right after `finish()` returns (several runs in one process)
    it can still be unwritten, so the exit record is waited for (the process's own teardown flushes it at exit)."""
    deadline = time.monotonic() + wait_s
    while True:
        [path] = sorted((Path(run_dir) / "wandb").glob("offline-run-*/run-*.wandb"))[-1:]
        kinds = [(r.WhichOneof("record_type"), r) for r in wandb_records(path)]
        exits = [r.exit.exit_code for kind, r in kinds if kind == "exit"]
        if exits:
            return exits[-1], any(kind == "preempting" for kind, _ in kinds)
        assert time.monotonic() < deadline, f"{path}: no exit record (the run was not finished)"
        time.sleep(0.2)

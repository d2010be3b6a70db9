"""Checkpoint checksums and write failures, without training: the SHA-256 check on load against a commit record
written here, its fallback and its stop, and the error torch's writer really raises on a full disk (a tmpfs)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest

from scaletrain.checkpoint.commit import (
    checksum_shares,
    describe_write_failure,
    find_damage,
    is_write_failure,
    verified_resume_checkpoint,
)
from scaletrain.errors import UsageError
from tests.harness import free_port, small_tmpfs


def committed(folder: Path, files: dict, checksums: bool = True) -> Path:
    """A committed checkpoint folder: `files` ({name: bytes}) and a commit.json with their sizes (and SHA-256)."""
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    record = {"step": 0, "files": {name: len(data) for name, data in files.items()}}
    if checksums:
        record["sha256"] = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    (folder / "commit.json").write_text(json.dumps(record))
    return folder


def flip_a_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def one_rank_group(monkeypatch):
    """A real 1-rank gloo process group (the collectives of the check run; with one rank they return at once)."""
    import deepspeed
    import deepspeed.comm as ds_comm

    for var, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }.items():
        monkeypatch.setenv(var, value)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    yield
    ds_comm.destroy_process_group()


def test_find_damage_names_a_changed_file_of_the_same_size(tmp_path):
    files = {"model.pt": os.urandom(5000), "optim.pt": os.urandom(20000), "train_state.json": b"{}"}
    ckpt = committed(tmp_path / "step8", files)
    assert find_damage(ckpt, rank=0, world_size=1) is None
    flip_a_middle_byte(ckpt / "optim.pt")
    assert (ckpt / "optim.pt").stat().st_size == 20000
    assert find_damage(ckpt, rank=0, world_size=1) == "optim.pt"
    # Each rank checks its share: the rank without optim.pt finds nothing (the gather tells it the other's find).
    shares = checksum_shares(json.loads((ckpt / "commit.json").read_text())["files"], 2)
    assert find_damage(ckpt, rank=[i for i, s in enumerate(shares) if "optim.pt" not in s][0], world_size=2) is None


def test_an_older_commit_record_without_checksums_is_accepted_on_its_sizes(tmp_path):
    ckpt = committed(tmp_path / "step8", {"model.pt": os.urandom(100)}, checksums=False)
    flip_a_middle_byte(ckpt / "model.pt")
    assert find_damage(ckpt, rank=0, world_size=1) is None


def test_checksum_shares_hash_every_file_once_with_balanced_bytes():
    files = {f"f{i}": size for i, size in enumerate([900, 500, 400, 300, 300, 200, 100, 7])}
    shares = checksum_shares(files, 3)
    assert sorted(name for share in shares for name in share) == sorted(files)
    loads = [sum(files[name] for name in share) for share in shares]
    assert max(loads) - min(loads) <= max(files.values()), loads


def test_a_damaged_auto_checkpoint_falls_back_and_is_never_picked_again(tmp_path, one_rank_group):
    root = tmp_path / "checkpoints"
    older = committed(root / "step8", {"model.pt": os.urandom(3000)})
    newest = committed(root / "step16", {"model.pt": os.urandom(3000)})
    (root / "latest").write_text("step16\n")
    flip_a_middle_byte(newest / "model.pt")
    assert verified_resume_checkpoint(newest, auto=True, rank=0, world_size=1) == older
    assert not newest.exists() and (root / "damaged-step16" / "model.pt").is_file()  # kept, under another name
    assert (root / "latest").read_text().strip() == "step8"
    from scaletrain.checkpoint.commit import newest_committed

    assert newest_committed(str(tmp_path)) == older  # a later auto resume skips it without hashing anything


def test_a_damaged_checkpoint_asked_for_or_without_predecessor_stops(tmp_path, one_rank_group):
    root = tmp_path / "checkpoints"
    committed(root / "step8", {"model.pt": os.urandom(3000)})
    newest = committed(root / "step16", {"model.pt": os.urandom(3000)})
    flip_a_middle_byte(newest / "model.pt")
    with pytest.raises(
        UsageError,
        match=r"--resume_from_checkpoint .*step16: the checkpoint is damaged: model.pt "
        r"does not match its sha256 in commit.json",
    ):
        verified_resume_checkpoint(newest, auto=False, rank=0, world_size=1)
    (root / "step8" / "commit.json").unlink()  # the older one was never committed
    with pytest.raises(
        UsageError,
        match=r"step16 is damaged: model.pt does not match its sha256 in commit.json, "
        r"and no earlier committed checkpoint is left to fall back to",
    ):
        verified_resume_checkpoint(newest, auto=True, rank=0, world_size=1)
    assert newest.is_dir()  # left in place: the next start stops again instead of starting afresh


def test_the_errors_of_a_full_disk_are_recognised_in_both_forms(tmp_path):
    """torch 2.13's zip writer raises a RuntimeError without an errno; a plain write raises OSError ENOSPC."""
    import torch

    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        with pytest.raises(RuntimeError) as torch_error:
            torch.save({"t": torch.zeros(2**19)}, disk / "x.pt")  # 2 MB
        (disk / "x.pt").unlink(missing_ok=True)
        with pytest.raises(OSError) as os_error:
            (disk / "y").write_bytes(b"\0" * 2**21)
        assert os_error.value.errno == errno.ENOSPC
        for err in (torch_error.value, os_error.value):
            assert is_write_failure(err), repr(err)
            assert describe_write_failure(err, disk).startswith("no space left on device, 0.00 GB free"), repr(err)
    assert not is_write_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))

"""Checkpoint write failures, without training: the error torch's writer really raises on a full disk (a tmpfs)."""

from __future__ import annotations

import errno

import pytest

from scaletrain.checkpoint import describe_write_failure, is_write_failure
from tests.conftest import small_tmpfs


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

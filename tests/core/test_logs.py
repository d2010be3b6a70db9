"""Rank-aware logging: INFO from rank 0 only; warnings, Python's included, from every rank, with the rank, each
message once per rank."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness import REPO

SCRIPT = """
import logging, sys, warnings
from scaletrain.logs import setup_logging
setup_logging(int(sys.argv[1]))
log = logging.getLogger("scaletrain.test")
log.info("an info line")
for _ in range(3):
    warnings.warn("only this rank's disk is slow")
log.warning("our own warning")
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_shows_each_warning_once_with_its_rank(rank):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(rank)], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    python_warnings = [line for line in lines if "only this rank's disk is slow" in line]
    assert len(python_warnings) == 1 and f"[rank{rank}] WARNING" in python_warnings[0], proc.stdout
    assert any(f"[rank{rank}] WARNING our own warning" in line for line in lines)
    assert any("an info line" in line for line in lines) == (rank == 0)  # INFO from rank 0 only

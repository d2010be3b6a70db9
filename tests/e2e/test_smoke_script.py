"""scripts/smoke_test.sh from an environment that is not this repository's .venv (a venv elsewhere, a conda env):
it must find the deepspeed launcher beside the interpreter it is given, not look for ./deepspeed."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.harness import REPO, VENV_BIN, child_env


@pytest.mark.slow
def test_smoke_test_runs_with_an_interpreter_found_on_path(tmp_path):
    env = {
        **child_env(tmp_path / "cache"),
        "PYTHON": "python",
        "NPROC": "1",
        "TMPDIR": str(tmp_path),
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("DEEPSPEED", None)
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "smoke_test.sh"), "zero2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].startswith("PASS zero2 (1 ranks"), proc.stdout
    assert proc.stdout.splitlines()[-1] == "1 passed, 0 failed"


def test_smoke_test_says_so_when_no_launcher_can_be_found(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    script = fake / "python3"  # an interpreter (the system's, which has no deepspeed) with no launcher beside it
    script.write_text('#!/bin/sh\nexec /usr/bin/python3 "$@"\n')
    script.chmod(0o755)
    env = {"PATH": f"{fake}{os.pathsep}/usr/bin:/bin", "PYTHON": str(script), "NPROC": "1", "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "smoke_test.sh"), "zero2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no deepspeed launcher beside" in proc.stdout


@pytest.mark.extended  # ~60 s; TP and PP trains: test_tensor_parallel.py, test_pipeline_parallel.py
@pytest.mark.slow  # two ranks, two layouts
def test_smoke_test_runs_tensor_and_pipeline_parallel_layouts(tmp_path):
    env = {**child_env(tmp_path / "cache"), "NPROC": "2", "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "smoke_test.sh"), "zero2_tp2", "zero1_pp2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("PASS zero2_tp2 (2 ranks") and lines[1].startswith("PASS zero1_pp2 (2 ranks"), lines
    for name, layout in (("zero2_tp2", "tensor parallel 2"), ("zero1_pp2", "pipeline parallel 2")):
        log = next((tmp_path).glob(f"smoke.*/{name}.log")).read_text()
        assert f"layout: {layout} x data parallel 1" in log

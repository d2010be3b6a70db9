"""DeepSpeed's compiled ops: which ones a config needs, and a stale torch build lock never hangs a run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scaletrain.engine import ops
from tests.conftest import FAST_FLAGS, REPO, check_ok, launch

TRAIN = REPO / "train.py"


def ds_config(name: str) -> dict:
    return json.loads((REPO / "ds_configs" / f"{name}.json").read_text())


def test_engine_ops_follow_offload_optimizer_and_accelerator():
    assert ops.engine_ops(ds_config("zero1"), "cpu") == []
    assert ops.engine_ops(ds_config("zero2_offload"), "cpu") == ["CPUAdamBuilder"]
    assert ops.engine_ops(ds_config("zero3_offload"), "cpu") == ["CPUAdamBuilder"]
    assert ops.engine_ops(ds_config("zero3_nvme"), "cpu") == ["AsyncIOBuilder", "CPUAdamBuilder"]
    # On a GPU, DeepSpeed's fused Adam unless the config asks for torch's
    assert ops.engine_ops(ds_config("zero3"), "cuda") == ["FusedAdamBuilder"]
    torch_adam = ds_config("zero3")
    torch_adam["optimizer"]["params"]["torch_adam"] = True
    assert ops.engine_ops(torch_adam, "cuda") == []
    assert ops.engine_ops(ds_config("zero2_offload"), "cuda") == ["CPUAdamBuilder"]
    assert ops.comm_ops("cpu", 2) == ["ShareMemCommBuilder"]
    assert ops.comm_ops("cpu", 1) == [] and ops.comm_ops("cuda", 8) == []


@pytest.mark.slow
def test_stale_build_locks_are_removed_and_a_two_rank_offload_run_finishes(
    tmp_path, cache_dir, monkeypatch, compiled_ops
):
    """Regression: a process killed mid-build left torch's `lock` file; every later offload run waited forever."""
    warm = {op: Path(ops.build_directory(op)) for op in ("cpu_adam", "deepspeed_shm_comm")}  # built by compiled_ops
    extensions = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    folders = {op: Path(ops.build_directory(op)) for op in warm}  # where the run will look: torch's own rule
    for op, folder in folders.items():
        shutil.rmtree(folder)
        shutil.copytree(warm[op], folder, ignore=shutil.ignore_patterns("lock"))
        (folder / "lock").touch()
    run_dir = tmp_path / "run"
    proc = launch(
        TRAIN,
        [
            "--config",
            "ds_configs/zero2_offload.json",
            "--output_dir",
            str(run_dir),
            "--max_steps",
            "2",
            "--save_steps",
            "0",
            *FAST_FLAGS,
        ],
        "deepspeed",
        cache_dir,
        nprocs=2,
        timeout=600,
        env={"TORCH_EXTENSIONS_DIR": str(extensions)},
    )
    check_ok(proc)
    for folder in folders.values():
        assert not (folder / "lock").exists()
        assert f"removing a stale build lock {folder / 'lock'}" in proc.stdout
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2

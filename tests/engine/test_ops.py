"""DeepSpeed's compiled ops: which ones a config needs, a build said before it starts (what, why, how long), and a stale
torch build lock that never hangs a run."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from scaletrain.engine import ops
from tests.harness import FAST_FLAGS, REPO, check_ok, launch, read_metrics

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


def test_the_cpu_probe_runs_once_per_host_boot(tmp_path, monkeypatch):
    """py-cpuinfo's probe (a fresh interpreter, ~1.2 s), which DeepSpeed's CPU op builders call three times per rank
    to load cpu_adam: probed once, then answered from this process and from a file of this host's boot."""
    import cpuinfo

    from scaletrain.engine import ds_internals

    real, calls = cpuinfo.get_cpu_info, []

    def install(probe) -> None:  # a fresh process: py-cpuinfo's own function, then ours over it
        def counted():
            calls.append(1)
            return probe()

        monkeypatch.setattr(cpuinfo, "get_cpu_info", counted)
        ds_internals.remember_cpu_info(str(tmp_path))

    install(real)
    first = cpuinfo.get_cpu_info()
    assert first["arch"] and first["flags"]
    first["flags"].append("changed by a caller")  # each caller gets its own copy
    again = [cpuinfo.get_cpu_info() for _ in range(2)]
    assert again[0] == again[1] and "changed by a caller" not in again[0]["flags"] and len(calls) == 1
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    [kept] = tmp_path.glob("cpuinfo-*.json")
    assert kept.name == f"cpuinfo-{socket.gethostname()}-{boot}.json"
    ds_internals.remember_cpu_info(str(tmp_path))  # installed once: not wrapped twice
    assert cpuinfo.get_cpu_info()["arch"] == first["arch"] and len(calls) == 1

    install(real)  # the next rank or run of this boot reads the file and never probes
    assert cpuinfo.get_cpu_info() == json.loads(kept.read_text()) and len(calls) == 1

    kept.write_text("{")  # damaged: probed again, and rewritten
    install(real)
    assert cpuinfo.get_cpu_info() == json.loads(kept.read_text()) and len(calls) == 2

    kept.unlink()  # a failed probe (py-cpuinfo answers {}) is not kept
    install(dict)
    assert cpuinfo.get_cpu_info() == {} and not kept.exists() and len(calls) == 3


def test_a_build_is_said_before_it_starts_with_what_why_and_how_long(tmp_path):
    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    notice = ops.build_notice("deepspeed_shm_comm", str(folder))
    assert f"building DeepSpeed op deepspeed_shm_comm in {folder} (missing" in notice and "about 35 s" in notice
    (folder / "deepspeed_shm_comm.so").write_bytes(b"")  # built, before builds were recorded: nothing foretold
    assert ops.build_notice("deepspeed_shm_comm", str(folder)) is None
    ops.record_build(str(folder))  # built for this environment: a load of seconds, said by nothing
    assert ops.build_notice("deepspeed_shm_comm", str(folder)) is None
    another = {**json.loads((folder / ops.BUILD_RECORD).read_text()), "torch": "2.12.0", "deepspeed_sources": "/x"}
    (folder / ops.BUILD_RECORD).write_text(json.dumps(another))
    notice = ops.build_notice("deepspeed_shm_comm", str(folder))
    assert "(built for another environment: torch 2.12.0 -> " in notice and "deepspeed_sources /x -> " in notice
    assert "scripts/build_ops.py" in ops.build_notice("an_op_without_a_figure", str(folder))


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
    # cpu_adam's cache as another environment left it: the run says so before it loads (or rebuilds) it
    record = folders["cpu_adam"] / ops.BUILD_RECORD
    record.write_text(json.dumps({**ops.build_environment(), "deepspeed_sources": "/another/venv/deepspeed"}))
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
    # the ranks' probes of the CPU for cpu_adam (DeepSpeed's builder and optimizer): one, kept for this host's boot
    [kept] = folders["cpu_adam"].parent.glob("cpuinfo-*.json")
    assert json.loads(kept.read_text())["arch"]
    for folder in folders.values():
        assert not (folder / "lock").exists()
        assert f"removing a stale build lock {folder / 'lock'}" in proc.stdout
    assert read_metrics(run_dir)[-1]["step"] == 2
    said = proc.stdout.index("building DeepSpeed op cpu_adam")
    assert "(built for another environment: deepspeed_sources /another/venv/deepspeed -> " in proc.stdout[said:]
    assert said < proc.stdout.index("built DeepSpeed op cpu_adam in")

"""Asynchronous saves (scaletrain/checkpoint/async_save.py): the snapshot writes the bytes a synchronous save writes,
the writer process and its failures, and real DeepSpeed runs: the same committed checkpoints and losses as
synchronous saves (ZeRO-1/2/3 with offload, a pipeline), a writer killed mid-write, a kill -9 of the whole run
during a background write, and a preemption while a write is in flight."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import psutil
import pytest
import torch

from tests.harness import (
    FAST_FLAGS,
    REPO,
    check_ok,
    deepspeed_cmd,
    freeze,
    launch,
    logged_steps,
    memory_cgroup,
    small_tmpfs,
    child_env,
    thaw,
    train_losses,
)

from tests.checkpoint.test_checkpoint import wait_for

from scaletrain.checkpoint.async_save import (
    BUFFER_PREFIX,
    SHM_ROOT,
    WRITER_NAME,
    BackgroundWriter,
    HostBuffers,
    InFlight,
    Snapshot,
    snapshot_refusal,
    write_snapshot,
)
from scaletrain.observability.host_memory import CgroupMemory


SLOW_RANK = REPO / "tests" / "helpers" / "slow_rank.py"


def a_state_dict() -> dict:
    """What DeepSpeed's files hold, in small: views sharing a flat buffer, a parameter, distinct empty tensors (ZeRO-3
    placeholders), a tuple met twice (Adam's betas in two groups), a module state dict with its _metadata, a tensor
    with Python attributes, met twice."""
    flat = torch.randn(100)
    module = torch.nn.Linear(3, 2).state_dict()
    betas = (0.9, 0.95)
    tagged = torch.randn(6)
    tagged.ds_id = 7  # DeepSpeed's attributes on a partition, which torch.save keeps
    return {
        "tagged": [tagged, tagged],  # one tensor met twice
        "module": module,
        "groups": [flat[:10], flat[10:30].view(4, 5)],
        "param": torch.nn.Parameter(torch.randn(3)),
        "placeholders": [torch.empty(0), torch.empty(0)],
        "param_groups": [{"betas": betas, "lr": 1e-3}, {"betas": betas, "lr": 2e-3}],
        "nested": OrderedDict(x=torch.arange(5), y=[1, 2.0, "s", (flat[50:60], torch.Size([2, 3]))]),
        "bf16": torch.randn(4).to(torch.bfloat16),
    }


def test_a_snapshot_writes_the_bytes_torch_save_writes_even_after_the_tensors_changed(tmp_path):
    state = a_state_dict()
    (tmp_path / "sync").mkdir()
    torch.save(state, tmp_path / "sync" / "file.pt")
    gone = SHM_ROOT / f"{BUFFER_PREFIX}999999999-rank0-0"  # a killed run's: no such process
    gone.write_bytes(b"x")
    buffers = HostBuffers(f"{os.getpid()}-test")
    assert not gone.exists()
    try:
        snapshot = Snapshot(buffers)
        snapshot.take(state, tmp_path / "file.pt")
        state["groups"][0].add_(1)  # training goes on: the snapshot keeps the values it took
        state["param"].data.mul_(2)
        checksums = write_snapshot(str(tmp_path), snapshot.files, snapshot.buffers)
        assert (tmp_path / "file.pt").read_bytes() == (tmp_path / "sync" / "file.pt").read_bytes()
        assert list(checksums) == [str(tmp_path / "file.pt")]
        first = [path for path, _, _ in buffers.buffers]
        Snapshot(buffers).take(state, tmp_path / "again.pt")  # the next save reuses the same host buffers
        assert [path for path, _, _ in buffers.buffers] == first
    finally:
        buffers.release()
    assert not any(Path(path).exists() for path in first)


def test_the_snapshot_buffers_must_fit_in_half_the_memory_the_host_or_the_job_leaves_and_in_dev_shm():
    gb = 10**9
    host = {"cgroup": None}
    assert snapshot_refusal(2 * gb, 2, available=10 * gb, shm_free=10 * gb, **host) is None
    assert "more than half of the 6.00 GB" in snapshot_refusal(2 * gb, 2, available=6 * gb, shm_free=10 * gb, **host)
    assert "/dev/shm has 4.00 GB free" in snapshot_refusal(2 * gb, 2, available=100 * gb, shm_free=4 * gb, **host)
    job = CgroupMemory(Path("/sys/fs/cgroup/memory/slurm/uid_0/job_7"), limit=12 * gb, in_use=5 * gb)
    refusal = snapshot_refusal(2 * gb, 2, available=100 * gb, shm_free=100 * gb, cgroup=job)
    assert (
        "more than half of the 7.00 GB that the job's memory limit (12.00 GB, cgroup" in refusal and "job_7" in refusal
    )
    assert (
        snapshot_refusal(2 * gb, 2, available=100 * gb, shm_free=100 * gb, cgroup=CgroupMemory(job.path, 20 * gb, 0))
        is None
    )
    # the host's memory decides where it is tighter than the job's limit
    assert "of host memory available" in snapshot_refusal(2 * gb, 2, available=6 * gb, shm_free=10 * gb, cgroup=job)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_tightest_memory_cgroup_of_the_process_and_its_ancestors_is_read(tmp_path, version):
    """/proc/self/cgroup and mountinfo as a Slurm node shows them (the job's group under the mount point), in files:
    the job's group and its parent both limit memory; the one with less free counts, its inactive file cache free."""
    gb = 2**30
    mount = tmp_path / "sys" / "fs" / "cgroup" / ("memory" if version == "v1" else "")
    job, parent = mount / "slurm" / "uid_0" / "job_7" / "step_0", mount / "slurm" / "uid_0"
    names = {
        "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
        "v2": ("memory.max", "memory.current", "inactive_file"),
    }[version]
    for folder, limit, usage, inactive in ((job, 8 * gb, 6 * gb, 2 * gb), (parent, 100 * gb, 95 * gb, 0)):
        folder.mkdir(parents=True, exist_ok=True)
        for name, value in zip(names[:2], (limit, usage), strict=True):
            (folder / name).write_text(f"{value}\n")
        (folder / "memory.stat").write_text(f"cache 1\n{names[2]} {inactive}\nshmem 0\n")
    proc = tmp_path / "proc"
    proc.mkdir()
    if version == "v1":
        (proc / "cgroup").write_text("5:cpu,cpuacct:/slurm/uid_0/job_7/step_0\n4:memory:/slurm/uid_0/job_7/step_0\n")
        line = f"35 31 0:32 / {mount} rw,relatime - cgroup cgroup rw,memory"
    else:
        (proc / "cgroup").write_text("0::/slurm/uid_0/job_7/step_0\n")
        line = f"35 31 0:32 / {mount} rw,relatime - cgroup2 cgroup2 rw"
    (proc / "mountinfo").write_text(f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n{line}\n")
    found = CgroupMemory.of_this_process(proc)
    assert (found.path, found.limit, found.in_use, found.free) == (job, 8 * gb, 4 * gb, 4 * gb)
    (parent / names[1]).write_text(f"{99 * gb}\n")  # the parent (the user's jobs together) now has 1 GB free
    assert CgroupMemory.of_this_process(proc).path == parent
    (parent / names[0]).write_text("max\n" if version == "v2" else f"{2**63 - 4096}\n")  # no limit there
    (job / names[0]).write_text("max\n" if version == "v2" else f"{2**63 - 4096}\n")
    assert CgroupMemory.of_this_process(proc) is None


def _in_flight(tmp: Path) -> InFlight:
    return InFlight("step1", tmp, 1, None, {}, time.perf_counter())


def test_a_write_that_fails_and_a_writer_that_dies_are_reported_not_raised(tmp_path):
    writer = BackgroundWriter(rank=0)
    try:
        snapshot = writer.snapshot()
        snapshot.take({"w": torch.ones(3)}, tmp_path / "missing" / "file.pt")  # its folder does not exist
        writer.submit(_in_flight(tmp_path / "missing"), snapshot)
        assert writer.status(wait=True) == "failed"
        assert "missing does not exist" in writer.in_flight.result[2]  # torch.save's own words
        snapshot = writer.snapshot()
        snapshot.take({"w": torch.ones(3)}, tmp_path / "file.pt")
        freeze(writer.process.pid)  # mid-write, as far as the rank can tell
        writer.submit(_in_flight(tmp_path), snapshot)
        assert writer.status() == "writing"
        writer.process.kill()
        writer.process.join(timeout=30)
        assert writer.status() == "failed"
        assert "its writer process died (exit -9)" in writer.in_flight.result[2]
    finally:
        writer.close()


def test_a_preemption_signal_never_ends_a_starting_writer_and_the_ranks_handlers_stay():
    seen = []

    def handler(sig, frame) -> None:
        seen.append(sig)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    writer = BackgroundWriter(rank=0)
    try:
        writer.start()
        for sig in (signal.SIGUSR1, signal.SIGTERM):  # at once: the writer is still importing torch
            os.kill(writer.process.pid, sig)
        assert all(signal.getsignal(sig) is handler for sig in previous)  # the rank's own, back
        deadline = time.monotonic() + 60
        while psutil.Process(writer.process.pid).name() != WRITER_NAME:  # ready: it lived through both
            assert writer.process.is_alive() and time.monotonic() < deadline, writer.process.exitcode
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)  # the rank still hears them
        assert seen == [signal.SIGUSR1]
    finally:
        writer.close()
        for sig, old in previous.items():
            signal.signal(sig, old)


# --- real runs ------------------------------------------------------------------------------------------------------

STEPS, SAVE_EVERY = 12, 4


def flags(run_dir: Path, config: str = "zero2", *extra: str) -> list:
    return [
        "--config",
        f"ds_configs/{config}.json",
        "--output_dir",
        str(run_dir),
        "--max_steps",
        str(STEPS),
        "--save_steps",
        str(SAVE_EVERY),
        *FAST_FLAGS,
        "--logging_steps",
        "1",
        "--no-export_hf_at_end",
        *extra,
    ]


def checksums(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step{step}" / "commit.json").read_text())["sha256"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,extra",
    # ZeRO-1 through the pipeline's stages (its only stage); ZeRO-2 shares ZeRO-1's optimizer (the kill tests below
    # restart a ZeRO-2 run exactly from an asynchronous save); ZeRO-3 with CPU offload. The pipeline case is in the
    # extended run only, for CI's time (a pipeline run's save and exact restart is tested in CI by test_checkpoint.py)
    [
        ("zero3_offload", ()),
        pytest.param(
            "zero1",
            ("--pipeline_parallel_size", "2", "--gradient_accumulation_steps", "2"),
            marks=pytest.mark.extended,
        ),
    ],
    ids=["zero3-offload", "pipeline-zero1"],
)
def test_asynchronous_and_synchronous_saves_commit_the_same_bytes_and_train_the_same_losses(
    tmp_path, cache_dir, config, extra
):
    runs = {}
    for mode in ("--async_save", "--no-async_save"):
        run_dir = tmp_path / mode.strip("-")
        proc = launch(REPO / "train.py", flags(run_dir, config, *extra, mode), "deepspeed", cache_dir, nprocs=2)
        check_ok(proc)
        runs[mode] = (run_dir, proc.stdout + proc.stderr)
    (background, log), (synchronous, _) = runs["--async_save"], runs["--no-async_save"]
    assert "written in the background" in log and re.search(r"committed checkpoint \S+/step4", log)
    for step in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY):
        assert checksums(background, step) == checksums(synchronous, step), step  # SHA-256 of every file
    assert train_losses(background) == train_losses(synchronous)


def rank_pids(run_dir: Path) -> list:
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if str(run_dir) in (p.info["cmdline"] or []) and any(a.startswith("--local_rank") for a in p.info["cmdline"])
    ]


def writer_pids(ranks: list) -> list:
    """The ranks' writer processes (multiprocessing's spawn children; not its resource tracker)."""
    writers = []
    for rank in ranks:
        try:
            writers += [c.pid for c in psutil.Process(rank).children() if any("spawn_main" in a for a in c.cmdline())]
        except psutil.Error:  # a child ending (a zombie) while we look
            continue
    return writers


def start_with_a_write_in_flight(run_dir: Path, cache_dir: Path, *extra: str, before_thaw=None) -> tuple:
    """A 2-rank run whose save of step 8 is being written in the background, its writers frozen there (the save of
    step 4 committed); the ranks train on until the next save (or the end) waits for it: (the launch, the rank pids,
    the writer pids)."""
    proc = subprocess.Popen(
        deepspeed_cmd(2, SLOW_RANK, flags(run_dir, "zero2", *extra)),
        cwd=REPO,
        # every step slowed (rank 0 waits before each forward, rank 1 for it): the test freezes the ranks between the
        # commit of step 4, at a step boundary after it, and the save of step 8 with time to spare
        env={**child_env(cache_dir), "SCALETRAIN_TEST_SLOW_RANK": "0:0.25"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    checkpoints = run_dir / "checkpoints"
    # The writers start at the first background save (step 4's): hold the ranks from then until the writers are ready,
    # so that the first write is not held up by their start and step 4 commits steps before step 8's save.
    wait_for(lambda: len(rank_pids(run_dir)) == 2 and len(writer_pids(rank_pids(run_dir))) == 2, proc)
    ranks = rank_pids(run_dir)
    freeze(*ranks)
    wait_for(lambda: all(psutil.Process(w).name() == WRITER_NAME for w in writer_pids(ranks)), proc)
    thaw(*ranks)
    wait_for(lambda: (checkpoints / "step4" / "commit.json").exists(), proc)  # the save of step 4 committed
    freeze(*ranks)  # the next save is 4 steps away: stop here to freeze the idle writers before it
    assert not (checkpoints / ".tmp-step8").exists()
    writers = writer_pids(ranks)
    assert len(ranks) == len(writers) == 2, (ranks, writers)
    freeze(*writers)
    if before_thaw is not None:
        before_thaw()
    thaw(*ranks)
    # step 8's snapshot handed over, the writers frozen before writing. Each rank's own files in its folder are not
    # enough: they are written before the handover, and a writer killed before it is started afresh by the handover
    # (a writer that died idle loses nothing), which would then write and commit step 8. Rank 0 logs step 9 only
    # after both ranks reduced its gradients, so past their handovers.
    wait_for(lambda: len(list((checkpoints / ".tmp-step8").glob("rng_state_rank*.pt"))) == 2, proc)
    wait_for(lambda: max(logged_steps(run_dir), default=0) >= 9, proc)
    return proc, ranks, writers


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir) -> Path:
    """The same run, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("async") / "reference"
    check_ok(launch(REPO / "train.py", flags(run_dir), "deepspeed", cache_dir, nprocs=2))
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["writers", "everything"])
def test_a_kill_during_a_background_write_commits_nothing_and_the_restart_is_exact(
    tmp_path, cache_dir, reference, killed
):
    run_dir = tmp_path / "run"
    proc, ranks, writers = start_with_a_write_in_flight(run_dir, cache_dir)
    for pid in writers + (ranks if killed == "everything" else []):
        os.kill(pid, signal.SIGKILL)
    if killed == "everything":
        proc.kill()
    output = proc.communicate(timeout=300)[0]
    checkpoints = run_dir / "checkpoints"
    assert not (checkpoints / "step8").exists() and (checkpoints / "step4" / "commit.json").exists()
    if killed == "writers":  # the ranks learn of it at the next step boundary, and stop with one line
        assert proc.returncode == 1, output[-4000:]
        (line,) = re.findall(r"train\.py: error: checkpoint step8: .*", output)
        assert "could not write" in line and "its writer process died (exit -9)" in line, line
        assert "was not committed and its folder was removed" in line and "step4 is intact" in line
        assert not (checkpoints / ".tmp-step8").exists()
    deadline = time.monotonic() + 30
    while rank_pids(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    restart = launch(REPO / "train.py", flags(run_dir), "deepspeed", cache_dir, nprocs=2)
    check_ok(restart)
    assert re.search(r"resumed from \S+/step4 \(step 4,", restart.stdout + restart.stderr)
    assert not (checkpoints / ".tmp-step8").exists()  # the unfinished folder went at the next save
    resumed = train_losses(run_dir)
    assert resumed[-(STEPS - 4) :] == train_losses(reference)[4:]  # the steps after the restart, exactly


@pytest.mark.slow
def test_a_preemption_while_a_write_is_in_flight_commits_it_then_saves_and_exits_85(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    # 16 steps: the save of step 12 waits for step 8's write inside the loop, where a preemption is seen
    proc, ranks, writers = start_with_a_write_in_flight(run_dir, cache_dir, "--max_steps", "16")
    for pid in ranks:
        os.kill(pid, signal.SIGUSR1)
    time.sleep(2)  # the ranks agree on it and wait for the write in flight
    assert proc.poll() is None and not (run_dir / "checkpoints" / "step8").exists()
    thaw(*writers)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 85, output[-4000:]
    saved = int(re.search(r"preemption \(SIGUSR1\): checkpoint committed at step (\d+)", output).group(1))
    assert saved > 8
    for step in (8, saved):
        assert (run_dir / "checkpoints" / f"step{step}" / "commit.json").exists()


@pytest.mark.slow
def test_a_preemption_at_the_step_of_a_periodic_save_writes_it_once_and_the_restart_is_exact(
    tmp_path, cache_dir, reference
):
    """Rank 1 is signalled during step 8, whose save is due: the ranks agree at its boundary, the periodic save
    snapshots step 8 and the preemption commits that write, with no second save of the step, then exits 85."""
    run_dir = tmp_path / "run"
    preempted = launch(
        SLOW_RANK, flags(run_dir), "deepspeed", cache_dir, nprocs=2, env={"SCALETRAIN_TEST_SIGNAL_AT": "1:8"}
    )
    output = preempted.stdout + preempted.stderr
    assert preempted.returncode == 85, output[-4000:]
    # (rank 0's log: the signal reached rank 1 alone)
    assert re.search(r"preemption \(signal on another rank\): checkpoint committed at step 8 ", output), output[-4000:]
    assert len(re.findall(r"step 8 is already committed", output)) == 1
    assert not re.search(r"saved checkpoint \S+/step8", output)  # no synchronous write of it
    assert len(re.findall(r"committed checkpoint \S+/step8, written in the background", output)) == 1
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step*")) == ["step4", "step8"]
    restart = launch(REPO / "train.py", flags(run_dir), "deepspeed", cache_dir, nprocs=2)
    check_ok(restart)
    assert re.search(r"resumed from \S+/step8 \(step 8,", restart.stdout + restart.stderr)
    assert train_losses(run_dir)[-(STEPS - 8) :] == train_losses(reference)[8:]


def one_rank_run(run_dir: Path, *extra: str) -> list:
    """`python train.py` flags of a 1-rank run of STEPS steps saving every SAVE_EVERY, asynchronously if it can."""
    return [sys.executable, *extra, *flags(run_dir, "zero2", "--async_save")]


@pytest.mark.slow
def test_a_full_dev_shm_at_the_first_snapshot_makes_the_saves_synchronous_and_says_so_once(tmp_path, cache_dir):
    """/dev/shm (a 64 MB tmpfs here) had room at the start, and is full when the first buffer is made: its
    posix_fallocate fails with ENOSPC (no sparse file to SIGBUS on later), every save of the run is synchronous, and
    the run finishes with every checkpoint committed."""
    run_dir = tmp_path / "run"
    with small_tmpfs(tmp_path / "shm", "64m") as shm:
        proc = subprocess.run(
            one_rank_run(run_dir, str(REPO / "tests" / "helpers" / "shm_full.py")),
            cwd=Path.cwd(),
            env=child_env(cache_dir, SCALETRAIN_TEST_SHM=str(shm)),
            capture_output=True,
            text=True,
            timeout=600,
        )
        check_ok(proc)
        left = sorted(p.name for p in shm.iterdir())
    output = proc.stdout + proc.stderr
    (line,) = re.findall(r"--async_save: .*", output)
    assert f"{shm} cannot hold a " in line and "No space left on device" in line, line
    assert line.endswith("this and later saves are synchronous"), line
    assert "written in the background" not in output
    assert len(re.findall(r"saved checkpoint \S+/step\d+", output)) == STEPS // SAVE_EVERY
    for step in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY):
        assert (run_dir / "checkpoints" / f"step{step}" / "commit.json").is_file(), step
    assert left == ["filler"]  # the buffer that did not fit is not left behind


@pytest.mark.slow
def test_a_job_memory_limit_that_holds_training_but_not_the_buffers_saves_synchronously(tmp_path, cache_dir):
    """A real memory cgroup of 1.3 GB (a Slurm job's limit on a host with far more) around a 23M-parameter run, whose
    working set is about 0.8 GB once training: training fits, the 0.37 GB of snapshot buffers (charged to the job, as
    /dev/shm pages are) and the writer process do not fit in what the limit leaves (in a 1.6 GB limit they do, and
    are used). The run says why once, saves synchronously and finishes, where a background save would have pushed the
    job past its limit into the kernel's OOM killer."""
    from data.build_tiny_llama import tiny_llama_variant

    model = tiny_llama_variant(tmp_path / "model", hidden_size=512, intermediate_size=1408, num_hidden_layers=8)
    run_dir = tmp_path / "run"
    model_flags = ["--config_name", str(model), "--tokenizer_name", str(model), "--per_device_train_batch_size", "2"]
    with memory_cgroup(f"scaletrain-test-{os.getpid()}", 1_300_000_000) as procs:
        proc = subprocess.run(
            ["bash", "-c", f'echo $$ > {procs} && exec "$@"', "bash", *one_rank_run(run_dir, "train.py"), *model_flags],
            cwd=Path.cwd(),
            env=child_env(cache_dir),
            capture_output=True,
            text=True,
            timeout=600,
        )
    check_ok(proc)
    output = proc.stdout + proc.stderr
    (line,) = re.findall(r"--async_save: .*", output)
    assert "that the job's memory limit (1.30 GB, cgroup /sys/fs/cgroup/" in line, line
    assert "scaletrain-test-" in line and line.endswith("saves are synchronous"), line
    assert "written in the background" not in output
    for step in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY):
        assert (run_dir / "checkpoints" / f"step{step}" / "commit.json").is_file(), step


@pytest.mark.slow
def test_a_disk_that_fills_during_a_background_write_stops_every_rank_and_keeps_the_previous_checkpoint(
    tmp_path, cache_dir
):
    from tests.checkpoint.test_checkpoint_integrity import PAGE, fill

    with small_tmpfs(tmp_path / "disk", "80m") as disk:
        run_dir = disk / "run"
        checkpoints = run_dir / "checkpoints"
        step4 = lambda: sum(json.loads((checkpoints / "step4" / "commit.json").read_text())["files"].values())  # noqa: E731
        # The space check before step 8's snapshot passes (step 4's bytes, and two pages for the metrics lines up to
        # then), the write runs out: tmpfs gives whole pages, and the files take 3 pages more than their bytes or
        # more (test_checkpoint_integrity.py checks that on the same run).
        proc, _, writers = start_with_a_write_in_flight(
            run_dir, cache_dir, before_thaw=lambda: fill(disk, leave=step4() + 2 * PAGE)
        )
        thaw(*writers)
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 1, output[-4000:]
        lines = re.findall(r"train\.py: error: checkpoint step8: .*", output)
        assert len(lines) == 1, output[-4000:]
        line = lines[0]
        assert "no space left on device" in line and "not enough disk space" not in line, line
        assert f"the previous committed checkpoint {checkpoints / 'step4'} is intact" in line, line
        assert "Traceback" not in output
        assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step4"]  # nothing of step 8 is left

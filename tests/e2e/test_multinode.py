"""Multi-node launch: scripts/train.sbatch on a real two-node Slurm cluster, srun direct mode, requeue on
preemption, and a two-"node" torchrun rendezvous without Slurm.

The cluster is real Slurm (Debian's slurmctld, slurmd and munge), started on this machine by the project's own
scripts/local_slurm/up.sh: two slurmd processes emulate nodes n1 and n2, each with its own host name. Where Slurm
cannot be installed (no root, no apt) these tests are skipped, unless SCALETRAIN_REQUIRE_SLURM=1 (CI sets it), in
which case they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.harness import (
    FAST_FLAGS,
    REPO,
    VENV_BIN,
    check_ok,
    free_port,
    layout_flags,
    freeze,
    logged_steps,
    read_metrics,
    signal_pending,
    child_env,
    thaw,
)

pytestmark = pytest.mark.slow
SBATCH = REPO / "scripts" / "train.sbatch"
TRAIN_FLAGS = ["--config", "ds_configs/zero2.json", *FAST_FLAGS]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, cache_dir):
    """A two-node Slurm cluster for this module; stopped (by PID) afterwards, whatever happened."""
    if os.geteuid() != 0 or not (shutil.which("slurmctld") or shutil.which("apt-get")):
        message = "a local Slurm cluster needs root and apt (or Slurm installed)"
        if os.environ.get("SCALETRAIN_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    state = Path(tempfile.mkdtemp(prefix="scaletrain-slurm-", dir="/tmp"))
    env = {**os.environ, "SLURM_CI_DIR": str(state), "NNODES": "2"}
    try:
        up = subprocess.run(
            ["bash", str(REPO / "scripts" / "local_slurm" / "up.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert up.returncode == 0, f"local Slurm did not start:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
        job_env = {
            **child_env(cache_dir),
            "SLURM_CONF": str(state / "etc" / "slurm.conf"),
            "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
            "SCALETRAIN_PYTHON": sys.executable,
        }
        yield Cluster(job_env, tmp_path_factory.mktemp("slurm_jobs"), state)
    finally:
        subprocess.run(
            ["bash", str(REPO / "scripts" / "local_slurm" / "down.sh")], env=env, capture_output=True, timeout=120
        )
        shutil.rmtree(state, ignore_errors=True)


class Cluster:
    def __init__(self, env: dict, logs: Path, state: Path):
        self.env = env
        self.logs = logs
        self.state = state  # up.sh's folder: configs, logs, pid files

    def on_node(self, node: str, *command: str) -> None:
        """Run `command` in emulated node `node`'s own mount namespace (its slurmd's): what only that node sees."""
        pid = (self.state / "run" / f"slurmd-{node}.pid").read_text().strip()
        subprocess.run(["nsenter", "--target", pid, "--mount", "--", *command], check=True, timeout=30)

    def submit(self, sbatch_args: list, script_args: list = (), env: dict = None) -> str:
        cmd = ["sbatch", "--parsable", "--time=15", f"--output={self.logs}/job-%j.out", *sbatch_args, *script_args]
        proc = subprocess.run(
            cmd, cwd=REPO, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    def wait(self, job: str, timeout: float = 900) -> dict:
        """Poll until the job left the queue (sbatch --wait polls with back-off up to 32 s); its final facts."""
        deadline = time.monotonic() + timeout
        while self.queued(job):
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job], env=self.env)
                pytest.fail(f"job {job} still running after {timeout}s:\n{self.log(job)[-4000:]}")
            time.sleep(0.5)
        return self.facts(job)

    def queued(self, job: str) -> bool:
        out = subprocess.run(["squeue", "-h", "-j", job], env=self.env, capture_output=True, text=True).stdout
        return bool(out.strip())

    def facts(self, job: str) -> dict:
        out = subprocess.run(["scontrol", "show", "job", job], env=self.env, capture_output=True, text=True).stdout
        return dict(re.findall(r"(JobState|ExitCode|Restarts)=(\S+)", out))

    def log(self, job: str) -> str:
        path = self.logs / f"job-{job}.out"
        return path.read_text() if path.exists() else ""


def metric_steps(run_dir: Path) -> list:
    return [r["step"] for r in read_metrics(run_dir) if "tokens_per_s" in r]


def test_sbatch_two_nodes_trains_commits_and_exports(slurm, tmp_path):
    from scaletrain.checkpoint.commit import verify

    run_dir = tmp_path / "run"
    job = slurm.submit(["--nodes=2", str(SBATCH)], [*TRAIN_FLAGS, "--output_dir", str(run_dir), "--max_steps", "6"])
    facts, log = slurm.wait(job), slurm.log(job)
    assert (facts["JobState"], facts["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert "node 0: n1 starts 1 rank(s)" in log and "node 1: n2 starts 1 rank(s)" in log
    assert "world size 2 on 2 host(s): n1 (ranks 0), n2 (ranks 1)" in log  # the ranks' own report
    assert verify(run_dir / "checkpoints" / "step6") is None
    assert (run_dir / "model.safetensors").exists() and (run_dir / "config.json").exists()
    assert metric_steps(run_dir) == [2, 4, 6]


def _preempt_when(slurm, job: str, run_dir: Path, ready, batch_signal: str) -> int:
    """Once `ready(logged steps)`, stop both ranks, signal the batch step as a scheduler would, let them go on once
    SIGUSR1 waits in both; the step they were stopped at."""
    deadline = time.monotonic() + 600
    while not ready(logged_steps(run_dir)):
        assert time.monotonic() < deadline and slurm.queued(job), slurm.log(job)[-4000:]
        time.sleep(0.05)
    # Stop both ranks there, so the job cannot end before the signal reaches them, however fast the machine.
    ranks = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if str(run_dir) in (p.info["cmdline"] or []) and any(a.startswith("--local_rank") for a in p.info["cmdline"])
    ]
    assert len(ranks) == 2, ranks
    freeze(*ranks)
    stopped_at = max(logged_steps(run_dir))
    assert stopped_at + 2 < 40
    # What --signal=B:USR1@lead does at the lead time, delivered now (the scheduler's own timing is +-60 s): the
    # batch script forwards it to the job steps; once it waits in both stopped ranks, they may go on.
    subprocess.run(["scancel", "--batch", f"--signal={batch_signal}", job], env=slurm.env, check=True)
    deadline = time.monotonic() + 60
    while not all(signal_pending(pid, signal.SIGUSR1) for pid in ranks):
        assert time.monotonic() < deadline, f"SIGUSR1 did not reach both ranks\n{slurm.log(job)[-4000:]}"
        time.sleep(0.05)
    thaw(*ranks)
    return stopped_at


def test_preemption_signals_save_requeue_and_resume_each_time(slurm, tmp_path):
    """One job preempted twice: USR1 (what --signal=B:USR1@lead sends), then, in the requeued run, TERM (a scheduler
    that signals the batch step). Each time the ranks commit a checkpoint at the next step boundary, exit 85, the job
    requeues itself and the next run resumes there; over the three runs every step is trained exactly once."""
    run_dir = tmp_path / "run"
    job = slurm.submit(
        ["--nodes=2", str(SBATCH)],
        [*TRAIN_FLAGS, "--output_dir", str(run_dir), "--max_steps", "40", "--logging_steps", "1"],
    )
    first = _preempt_when(slurm, job, run_dir, lambda steps: len(steps) >= 6, "USR1")
    pattern = r"preemption \(SIGUSR1\): checkpoint committed at step (\d+)"
    deadline = time.monotonic() + 600
    while not re.search(r"resumed from \S+/step\d+", slurm.log(job)):  # the requeued run is training
        assert time.monotonic() < deadline and slurm.queued(job), slurm.log(job)[-4000:]
        time.sleep(0.2)
    saved_first = int(re.search(pattern, slurm.log(job)).group(1))
    second = _preempt_when(slurm, job, run_dir, lambda steps: steps and max(steps) >= saved_first + 4, "TERM")
    facts, log = slurm.wait(job), slurm.log(job)
    assert (facts["JobState"], facts["ExitCode"], facts["Restarts"]) == ("COMPLETED", "0:0", "2"), log[-4000:]
    saved = [int(step) for step in re.findall(pattern, log)]
    assert len(saved) == 2, log[-4000:]
    # the step boundary after the signal (or the next one, for a rank stopped inside that step's agreement)
    for stopped_at, step in zip((first, second), saved, strict=True):
        assert stopped_at < step <= stopped_at + 2, (stopped_at, step)
        assert re.search(rf"resumed from \S+/step{step} \(step {step},", log)
    assert log.count("exit 85): requeueing job") == 2, log[-4000:]
    assert f"job {job} (restart 1)" in log and f"job {job} (restart 2)" in log  # SLURM_RESTART_COUNT
    assert metric_steps(run_dir) == list(range(1, 41))  # every step exactly once across the three runs


def _freeze_rank_1_of_a_new_attempt(slurm, job: str, run_dir: Path, attempts_before: int) -> int:
    """Once the run's next attempt (its heartbeat folder the `attempts_before + 1`-th) has trained two steps, with a
    checkpoint committed, SIGSTOP its rank 1 (on node n2, alone there: nobody on its host can kill it but its
    launcher); its pid."""
    deadline, seen = time.monotonic() + 600, None
    while True:
        assert time.monotonic() < deadline and slurm.queued(job), slurm.log(job)[-4000:]
        folders = sorted((run_dir / "hang").glob("*/heartbeat")) if (run_dir / "hang").is_dir() else []
        if len(folders) > attempts_before and not (folders[-1].parent / "report.txt").exists():
            seen = max(logged_steps(run_dir) or [0]) if seen is None else seen  # where this attempt started
            beat = folders[-1] / "rank-00001.json"
            step = json.loads(beat.read_text())["step"] if beat.exists() else 0
            if step >= seen + 3 and (run_dir / "checkpoints" / "latest").exists():  # committed (saves are async)
                pid = json.loads(beat.read_text())["pid"]
                freeze(pid)
                return pid
        time.sleep(0.1)


def test_a_hang_is_requeued_once_and_a_second_hang_ends_the_job(slurm, tmp_path):
    """Rank 1 frozen (SIGSTOP) on node n2: rank 0 names it and exits 86, n2's launcher SIGKILLs it, train.sbatch
    requeues the job once; the requeued run resumes, and when rank 1 freezes again the job ends with 86."""
    run_dir = tmp_path / "run"
    flags = ["--output_dir", str(run_dir), "--max_steps", "400", "--save_steps", "2", "--logging_steps", "1"]
    # n2's launcher kills its frozen rank 8 s after the report instead of 20 (the variable reaches it through the
    # job's environment, also in the requeued run); n1's launcher too would kill rank 0 if it were still there after
    # 8 s, where it takes well under a second to dump its stacks, say its line and exit 86
    job = slurm.submit(
        ["--nodes=2", str(SBATCH)],
        [*TRAIN_FLAGS, *flags, "--hang_timeout", "6"],
        env={"SCALETRAIN_HANG_KILL_AFTER_S": "8"},
    )
    victims = [_freeze_rank_1_of_a_new_attempt(slurm, job, run_dir, 0)]
    victims.append(_freeze_rank_1_of_a_new_attempt(slurm, job, run_dir, 1))
    facts, log = slurm.wait(job, timeout=600), slurm.log(job)
    assert (facts["JobState"], facts["ExitCode"], facts["Restarts"]) == ("FAILED", "86:0", "1"), log[-4000:]
    assert log.count("train.py: hang: ") == 2, log[-4000:]
    assert log.count("requeueing job") == 1 and "training hung again (exit 86" in log, log[-4000:]
    assert re.search(r"resumed from \S+/step\d+", log)
    assert len(list((run_dir / "hang").glob("*/report.txt"))) == 2
    for pid in victims:  # killed by n2's launcher (SIGTERM would wait for a frozen process forever)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert "rank process" in log and "killed (SIGKILL)" in log


def test_srun_direct_mode_maps_slurm_ranks(slurm, tmp_path):
    run_dir = tmp_path / "run"
    command = " ".join(
        ["srun", sys.executable, "train.py", *TRAIN_FLAGS, "--output_dir", str(run_dir), "--max_steps", "4"]
    )
    job = slurm.submit(["--nodes=2", "--ntasks-per-node=1", "--wrap", command])
    facts, log = slurm.wait(job), slurm.log(job)
    assert (facts["JobState"], facts["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert "launch: srun, world size 2 on 2 host(s): n1 (ranks 0), n2 (ranks 1)" in log
    assert metric_steps(run_dir) == [2, 4]


def test_a_tensor_group_across_the_nodes_is_refused_and_runs_when_allowed(slurm, tmp_path):
    """srun with one task a node and --tensor_parallel_size 2: the tensor group spans n1 and n2, refused on each
    node with exit 2 before the model is built; --allow_cross_node_tensor_parallel runs it, the launch line naming the
    group and both hosts."""
    flags = ["--config", "ds_configs/zero1.json", *FAST_FLAGS, "--tensor_parallel_size", "2", "--max_steps", "2"]
    jobs = {}
    for name, extra in (("refused", []), ("allowed", ["--allow_cross_node_tensor_parallel"])):
        command = ["srun", sys.executable, "train.py", *flags, *extra, "--output_dir", str(tmp_path / name)]
        jobs[name] = slurm.submit(["--nodes=2", "--ntasks-per-node=1", "--wrap", " ".join(command)])
    facts, log = slurm.wait(jobs["refused"]), slurm.log(jobs["refused"])
    assert facts["ExitCode"] == "2:0", log[-4000:]
    refusal = "--tensor_parallel_size 2: tensor group 0-1@n1+n2 spans nodes (1 of 1 groups do)"
    assert log.count(refusal) == 2, log[-4000:]  # said once per node
    assert "this launch has 1 per node" in log and "M parameters" not in log  # refused before the model is built
    assert not (tmp_path / "refused" / "checkpoints").exists()
    facts, log = slurm.wait(jobs["allowed"]), slurm.log(jobs["allowed"])
    assert (facts["JobState"], facts["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert "layout: tensor parallel 2 x data parallel 1; tensor groups 0-1@n1+n2" in log and "M parameters" in log
    assert metric_steps(tmp_path / "allowed") == [2]


def test_tensor_inside_each_node_and_pipeline_across_the_nodes_matches_one_rank(slurm, layout_reference, tmp_path):
    """The layout for very large models, on two nodes of 2 ranks: TP 2 inside each node x PP 2 across them (stage
    0 on n1, stage 1 on n2; only activations cross the nodes), losses and gradient norms equal to one rank's."""
    from tests.distributed.test_composed_layouts import MICRO, TP_PP
    from tests.distributed.test_tensor_parallel import _assert_matches

    run_dir = tmp_path / "tp2_pp2"
    command = ["srun", sys.executable, "train.py", *layout_flags(run_dir, "zero1", *TP_PP, *MICRO[4])]
    job = slurm.submit(["--nodes=2", "--ntasks-per-node=2", "--wrap", " ".join(command)])
    facts, log = slurm.wait(job), slurm.log(job)
    assert (facts["JobState"], facts["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert (
        "layout: tensor parallel 2 x pipeline parallel 2 x data parallel 1; tensor groups 0-1@n1, 2-3@n2; "
        "pipeline groups 0,2@n1+n2, 1,3@n1+n2"
    ) in log
    _assert_matches(run_dir, layout_reference)


def test_sbatch_bad_input_fails_once_and_early(slurm, tmp_path):
    missing = slurm.submit(
        ["--nodes=2", str(SBATCH)], ["--config", "ds_configs/nope.json", "--output_dir", str(tmp_path / "a")]
    )
    too_many = slurm.submit(
        ["--nodes=2", str(SBATCH)], [*TRAIN_FLAGS, "--output_dir", str(tmp_path / "b")], env={"SCALETRAIN_NNODES": "3"}
    )
    tasks = slurm.submit(
        ["--nodes=2", "--ntasks-per-node=2", str(SBATCH)], [*TRAIN_FLAGS, "--output_dir", str(tmp_path / "c")]
    )
    for job, message in (
        (missing, "train.py: error: --config ds_configs/nope.json: no such file"),
        (too_many, "SCALETRAIN_NNODES=3 but Slurm granted 2 node(s)"),
        (tasks, "one launcher per node: got 4 tasks on 2 node(s)"),
    ):
        facts, log = slurm.wait(job), slurm.log(job)
        assert (facts["JobState"], facts["ExitCode"]) == ("FAILED", "2:0"), log[-3000:]
        assert log.count(message) == 1, log[-3000:]
        assert "starts 1 rank(s)" not in log and "Traceback" not in log  # nothing was launched
    assert not any((tmp_path / name).exists() for name in "abc")


def test_a_model_folder_missing_on_one_node_is_printed_there_and_fails_the_job_fast(slurm, tmp_path):
    """Issue 14, item 4: the model folder is node-local and n2's copy is missing (an empty folder mounted over it in
    n2's mount namespace only; the batch script's --print_config check runs on n1 and passes). Before, n2's rank
    exited 2 without a word (usage errors were printed by global rank 0 only) and n1's rank waited for it at the
    rendezvous until the job's time limit."""
    model, empty = tmp_path / "model", tmp_path / "empty"
    shutil.copytree(REPO / "data" / "tiny-llama", model)
    empty.mkdir()
    slurm.on_node("n2", "mount", "--bind", str(empty), str(model))
    try:
        run_dir = tmp_path / "run"
        job = slurm.submit(
            ["--nodes=2", str(SBATCH)],
            [*TRAIN_FLAGS, "--config_name", str(model), "--output_dir", str(run_dir), "--max_steps", "4"],
        )
        started = time.monotonic()
        facts, log = slurm.wait(job, timeout=300), slurm.log(job)
    finally:
        slurm.on_node("n2", "umount", str(model))
    assert (facts["JobState"], facts["ExitCode"]) == ("FAILED", "2:0"), log[-4000:]
    assert time.monotonic() - started < 180, log[-4000:]  # not the rendezvous timeout
    errors = [line for line in log.splitlines() if line.startswith("train.py: ")]
    assert len(errors) == 2, log[-4000:]
    assert errors[0].startswith(f"train.py: error: [n2] --config_name {model}: ") or errors[1].startswith(
        f"train.py: error: [n2] --config_name {model}: "
    ), log[-4000:]
    assert f"train.py: stopped: [n1] rank 1 on n2 could not go on: --config_name {model}: " in log, log[-4000:]
    assert "Traceback" not in log and not run_dir.exists()


def test_train_sbatch_outside_slurm_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(SBATCH), *TRAIN_FLAGS], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "scripts/train.sbatch: error: not inside a Slurm job (no SLURM_JOB_ID); submit it: sbatch --nodes=N "
        "scripts/train.sbatch --config ds_configs/zero3.json [train.py flags]"
    ]


def test_torchrun_two_node_rendezvous_without_slurm(tmp_path, cache_dir):
    """The documented multi-node torchrun command, both "nodes" on localhost (node ranks 0 and 1)."""
    run_dir = tmp_path / "run"
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                str(VENV_BIN / "torchrun"),
                "--nnodes",
                "2",
                "--node_rank",
                str(rank),
                "--nproc_per_node",
                "1",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                f"127.0.0.1:{port}",
                "--rdzv_id",
                "test",
                "train.py",
                *TRAIN_FLAGS,
                "--output_dir",
                str(run_dir),
                "--max_steps",
                "4",
            ],
            cwd=REPO,
            env=child_env(cache_dir),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=900)[0] for node in nodes]
    for node, output in zip(nodes, outputs, strict=True):
        check_ok(subprocess.CompletedProcess(node.args, node.returncode, output, ""))
    assert sum("launch: torchrun/deepspeed, world size 2" in out for out in outputs) == 1
    assert metric_steps(run_dir) == [2, 4]

"""Ranks agree on every decision, every wait has a way out, every node's error is seen (issue 14, items 1, 2, 4).

Two "nodes" are two real processes started the way `srun python train.py` starts its tasks: no launcher, each with
its own rank in the environment, local rank 0, and its own working directory (what differs between nodes here is
what a relative path finds there). A launcher would stop the other ranks when one exits; these tests show that the
ranks stop by themselves, which is what a job needs where nothing else kills them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.harness import FAST_FLAGS, REPO, free_port, freeze, child_env
from tests.data.test_prepare_failures import write_corpus

HOST = socket.gethostname()
ZERO2 = REPO / "ds_configs" / "zero2.json"


def start_ranks(
    cache: Path, cwds: list, args: list, env: dict = None, slurm: bool = False, rank_envs: list = None
) -> list:
    """One process per rank, in its own working directory, with RANK/WORLD_SIZE (or srun's SLURM_* variables);
    `rank_envs`: variables of each rank's own (a node's local cache, say)."""
    port, procs = free_port(), []
    for rank, cwd in enumerate(cwds):
        rank_env = {**child_env(cache), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(env or {})}
        rank_env.update((rank_envs or [{}] * len(cwds))[rank])
        if slurm:  # srun direct mode: one node, two tasks
            rank_env.update(
                {
                    "SLURM_NTASKS": str(len(cwds)),
                    "SLURM_PROCID": str(rank),
                    "SLURM_LOCALID": str(rank),
                    "SLURM_JOB_ID": "4242",
                    "SLURM_STEP_ID": "0",
                    "SLURM_NTASKS_PER_NODE": str(len(cwds)),
                }
            )
        else:  # one rank per "node"
            rank_env.update({"RANK": str(rank), "WORLD_SIZE": str(len(cwds)), "LOCAL_RANK": "0"})
        procs.append(
            subprocess.Popen(
                [sys.executable, str(REPO / "train.py"), *args],
                cwd=cwd,
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def finish(procs: list, timeout: float) -> list:
    """(exit code, stderr) of each process; fails, killing them, when one still runs after `timeout` seconds."""
    deadline, results = time.monotonic() + timeout, []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        outputs = [p.communicate()[1][-2000:] for p in procs]
        pytest.fail(f"a rank still ran after {timeout:.0f}s:\n" + "\n---\n".join(outputs))
    return results


def error_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("train.py: ")]


def test_disagreement_names_the_first_differing_value():
    from scaletrain.distributed.agreement import disagreement

    def record(rank, host, **facts):
        return {"rank": rank, "host": host, "local_rank": 0, "facts": facts, "error": None}

    same = {"resume checkpoint": "none (a fresh start)", "run configuration": {"deepspeed": {"zero": 2}}}
    assert disagreement([record(0, "n1", **same), record(1, "n2", **same)]) is None
    resume = disagreement(
        [record(0, "n1", **same), record(1, "n2", **{**same, "resume checkpoint": "run/checkpoints/step4 (step 4)"})]
    )
    assert resume.splitlines()[0] == (
        "ranks disagree on the resume checkpoint: rank 1 on n2 has "
        "run/checkpoints/step4 (step 4), rank 0 on n1 has none (a fresh start); "
        "nothing was trained"
    )
    nested = disagreement(
        [
            record(0, "n1", **same),
            record(1, "n1", **same),
            record(2, "n2", **{**same, "run configuration": {"deepspeed": {"zero": 3}}}),
        ]
    )
    assert "rank 2 on n2 has deepspeed.zero=3, rank 0 on n1 has deepspeed.zero=2" in nested


@pytest.mark.slow  # two real ranks start up: ~30 s on a loaded 2-core machine
def test_ranks_that_read_different_configs_stop_with_one_message(tmp_path, cache_dir):
    """Item 1: node 1 runs its own copy of the DeepSpeed JSON (a relative --config: each node's checkout), edited
    there. Before, the two ranks trained together with different clipping and nobody noticed."""
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for cwd in cwds:
        (cwd / "ds_configs").mkdir(parents=True)
    (cwds[0] / "ds_configs" / "zero2.json").write_text(ZERO2.read_text())
    edited = {**json.loads(ZERO2.read_text()), "gradient_clipping": 0.5}
    (cwds[1] / "ds_configs" / "zero2.json").write_text(json.dumps(edited))
    out = tmp_path / "run"
    args = ["--config", "ds_configs/zero2.json", "--output_dir", str(out), "--max_steps", "2", *FAST_FLAGS]
    started = time.monotonic()
    results = finish(start_ranks(tmp_path / "cache", cwds, args), timeout=240)
    assert [code for code, _ in results] == [2, 2], results
    lines = [line for _, err in results for line in error_lines(err)]
    assert lines == [
        f"train.py: error: ranks disagree on the run configuration: rank 1 on {HOST} has "
        f"deepspeed.gradient_clipping=0.5, rank 0 on {HOST} has deepspeed.gradient_clipping=1.0; "
        "nothing was trained"
    ], results
    assert "Traceback" not in "".join(err for _, err in results)
    assert not out.exists()  # stopped before the run folder is written
    assert time.monotonic() - started < 180


@pytest.mark.slow  # two real ranks start up: ~30 s
def test_a_mistake_on_one_node_is_printed_there_and_stops_every_node_at_once(tmp_path, cache_dir):
    """Item 4: the model folder (a relative --config_name) exists on node 0 only. Before, node 1 exited 2 without a
    word (only global rank 0 printed usage errors) and node 0 waited for it at the rendezvous for 30 minutes."""
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for cwd in cwds:
        cwd.mkdir()
    (cwds[0] / "model").symlink_to(REPO / "data" / "tiny-llama")
    out = tmp_path / "run"
    args = ["--config", str(ZERO2), "--config_name", "model", "--output_dir", str(out), "--max_steps", "2", *FAST_FLAGS]
    started = time.monotonic()
    results = finish(start_ranks(tmp_path / "cache", cwds, args), timeout=240)
    elapsed = time.monotonic() - started
    assert [code for code, _ in results] == [2, 2], results
    node0_lines, node1_lines = error_lines(results[0][1]), error_lines(results[1][1])
    assert len(node0_lines) == 1 and len(node1_lines) == 1, results  # one line each (a hint line starts with "  ")
    node0, node1 = node0_lines[0], node1_lines[0]
    assert node1.startswith(f"train.py: error: [{HOST}] --config_name model"), results[1][1][-3000:]
    assert node0 == f"train.py: stopped: [{HOST}] rank 1 on {HOST} could not go on: {node1.split('] ', 1)[1]}"
    assert "Traceback" not in results[0][1] + results[1][1]
    assert not out.exists()
    assert elapsed < 180, f"{elapsed:.0f}s: the healthy node waited"


UNIVERSAL_WAIT = """
import os, sys, time
from pathlib import Path
import deepspeed
from scaletrain.checkpoint.resume import ensure_universal
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
started = time.monotonic()
try:
    ensure_universal(Path(sys.argv[1]), int(os.environ["RANK"]))
except Exception as err:
    print(f"ENDED after {time.monotonic() - started:.1f}s {type(err).__name__} "
          f"reported_by={getattr(err, 'reported_by', None)}: {err}", flush=True)
    sys.exit(1)
print("CONVERTED", flush=True)
"""


def start_conversion(tmp_path: Path) -> tuple:
    """Two ranks resuming a step folder that holds no DeepSpeed checkpoint: rank 0's converter fails on it."""
    ckpt = tmp_path / "checkpoints" / "step4"
    ckpt.mkdir(parents=True)
    (ckpt / "train_state.json").write_text("{}\n")
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", UNIVERSAL_WAIT, str(ckpt)],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={
                **child_env(tmp_path / "cache"),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )
        for rank in (0, 1)
    ]
    return ckpt, procs


@pytest.mark.slow  # DeepSpeed's converter and two ranks start: ~30 s
def test_a_failed_universal_conversion_ends_every_rank_with_its_reason(tmp_path, cache_dir):
    """Item 2: global rank 0's ds_to_universal fails (the step folder holds no DeepSpeed checkpoint). Before, the
    other ranks polled for its done-marker forever."""
    ckpt, procs = start_conversion(tmp_path)
    deadline, outputs = time.monotonic() + 240, []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail("a rank still waits for the failed conversion:\n" + procs[1].communicate()[1][-3000:])
    assert [p.returncode for p in procs] == [1, 1], outputs
    converter, waiter = (out[out.index("ENDED") :] if "ENDED" in out else out for out, _ in outputs)
    assert converter.startswith("ENDED") and "UniversalConversionFailed reported_by=every rank" in converter, outputs[0]
    assert "can't find *_optim_states.pt files" in converter  # the converter's own output, for the user
    assert f"converting {ckpt} to a universal checkpoint failed (DeepSpeed's ds_to_universal exited" in converter
    assert waiter.startswith("ENDED") and "reported_by=node" in waiter, outputs[1]
    assert f"waited for global rank 0's conversion of {ckpt} to a universal checkpoint: it failed (converting" in waiter
    assert float(waiter.split()[2].rstrip("s")) < 60, waiter  # once rank 0 failed, not at some timeout
    assert not (ckpt.parent / ".universal" / "step4.done").exists()


def is_converter(process: psutil.Process) -> bool:
    try:
        return any("ds_to_universal" in part for part in process.cmdline())
    except psutil.Error:  # ended (or a zombie) while we looked
        return False


@pytest.mark.slow  # DeepSpeed's converter and two ranks start: ~30 s
def test_a_rank_0_killed_while_converting_ends_the_waiting_rank(tmp_path, cache_dir):
    """Item 2: global rank 0 is SIGKILLed while its converter runs, so it writes no failure marker: the waiting rank
    sees the lock rank 0 held go free. Before, it polled for the done-marker forever."""
    ckpt, (converter, waiter) = start_conversion(tmp_path)
    try:
        deadline, running = time.monotonic() + 180, []
        while not running:
            assert converter.poll() is None, converter.communicate()
            assert time.monotonic() < deadline, "rank 0 never started the converter"
            running = [c for c in psutil.Process(converter.pid).children(recursive=True) if is_converter(c)]
            time.sleep(0.05)
        os.kill(converter.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for child in running:
            child.kill()
        try:
            out, err = waiter.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("rank 1 still waits for the killed rank 0 after 120 s")
    finally:
        for proc in (converter, waiter):
            if proc.poll() is None:
                proc.kill()
    assert time.monotonic() - killed_at < 60
    assert waiter.returncode == 1 and "ENDED" in out, err[-3000:]
    assert out[out.index("ENDED") :].split(": ", 1)[1].strip() == (
        f"waited for global rank 0's conversion of {ckpt} to a universal checkpoint: rank 0 ended without finishing "
        "it (killed? out of memory?); see its node's log, then restart"
    ), out


@pytest.mark.slow  # two real ranks and a preparation long enough to be killed in: ~40 s
def test_a_killed_preparer_under_srun_direct_mode_ends_the_waiting_rank(tmp_path, cache_dir):
    """Item 2: local rank 0 is SIGKILLed (as the out-of-memory killer does) while it tokenizes; the ranks were
    started as `srun python train.py` starts them (SLURM_* variables, no launcher to kill the others). Before,
    local rank 1 polled for the store's manifest forever."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", 30_000)
    cache = tmp_path / "cache"
    args = [
        "--config",
        str(ZERO2),
        "--output_dir",
        str(tmp_path / "run"),
        "--train_file",
        str(corpus),
        "--validation_split_percentage",
        "0",
        "--preprocessing_num_workers",
        "1",
        "--max_steps",
        "2",
        *FAST_FLAGS,
    ]
    procs = start_ranks(cache, [REPO, REPO], args, slurm=True)
    preparer, waiter = procs
    stores = cache / "scaletrain" / "token_stores"
    try:
        deadline = time.monotonic() + 180
        while not list(stores.glob(".*.tmp-*")):  # the store being written
            assert preparer.poll() is None and waiter.poll() is None, [p.communicate() for p in procs]
            assert time.monotonic() < deadline, "local rank 0 never started preparing"
            time.sleep(0.05)
        freeze(preparer.pid)  # stopped while it prepares: it cannot finish before the kill, however fast
        assert not list(stores.glob("*/manifest.json"))
        children = psutil.Process(preparer.pid).children(recursive=True)
        os.kill(preparer.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for child in children:  # its tokenizer workers, if any (the OOM killer takes a process, not its pool)
            child.kill()
        try:
            _, err = waiter.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("local rank 1 still waits for the killed preparer after 120 s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert time.monotonic() - killed_at < 60, err[-3000:]
    assert waiter.returncode == 1, err[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(
        f"train.py: error: waited for local rank 0 (pid {preparer.pid}) to prepare the token store "
    )
    assert "it ended without finishing it or saying why (killed? out of memory?)" in lines[0]
    assert "Traceback" not in err, err[-3000:]

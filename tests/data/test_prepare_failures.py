"""Token store preparation under failure and limits: a killed tokenizer worker, a full disk, a folder that is not a
store, ranks waiting on a preparation that fails, and --num_proc bounding the tokenizer's threads.

Everything here is real: data/prepare.py in a subprocess, SIGKILL sent to a real worker process, a real 1 MB tmpfs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.harness import REPO, freeze, small_tmpfs, child_env, thaw

TINY = REPO / "data" / "tiny-llama"
PREPARE = REPO / "data" / "prepare.py"


def write_corpus(path: Path, n_docs: int, words: int = 40) -> Path:
    with open(path, "w") as f:
        for i in range(n_docs):
            f.write(json.dumps({"text": " ".join(f"word{(i * 7 + j) % 997}" for j in range(words))}) + "\n")
    return path


def prepare_argv(corpus: Path, out: Path, *extra: str) -> list:
    return [
        "--train_file",
        str(corpus),
        "--tokenizer_name",
        str(TINY),
        "--block_size",
        "64",
        "--validation_split_percentage",
        "0",
        "--output_dir",
        str(out),
        *extra,
    ]


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MB file system (tmpfs): too small for the store of the corpus the test writes."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        yield disk


def spawned_children(pid: int) -> list:
    """Worker processes started by `pid` through multiprocessing's spawn (not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whatever reaps at pid 1 here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # real processes: starting ~10 s, working ~20 s (the fast tier stays under 3 minutes)
@pytest.mark.parametrize("when", ["starting", "working"])
def test_a_killed_tokenizer_worker_fails_the_prepare_in_one_line_and_keeps_nothing(when, tmp_path):
    """The OOM killer takes a worker: multiprocessing.Pool.imap would wait forever for its batch (and
    concurrent.futures' pool can trip over a worker dying while others start); the prepare must end instead."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", 30_000)  # 30 batches of 1000 documents for 9 workers
    out = tmp_path / "store"
    env = {**child_env(tmp_path / "cache"), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(PREPARE), *prepare_argv(corpus, out, "--num_proc", "9")],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def stored_bytes() -> int:
        return sum(p.stat().st_size for p in tmp_path.glob(".store.tmp-*/train.tokens.bin"))

    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"data/prepare.py ended before the kill:\n{proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "no tokenizer worker process was seen"
        workers = spawned_children(proc.pid)
        if workers and (when == "starting" or stored_bytes() > 0):  # working: the first batches are already stored
            break
        time.sleep(0.005)
    # Stop the preparing process there (it writes the store and starts the workers): it cannot finish or get any
    # further before the kill, however fast the machine.
    freeze(proc.pid)
    if when == "starting":
        assert stored_bytes() == 0, "the workers had already returned batches"
    else:
        assert stored_bytes() > 0 and not out.exists()
    killed, seen = workers[-1], workers
    assert running(killed)
    os.kill(killed, signal.SIGKILL)
    thaw(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        state = subprocess.run(
            ["pgrep", "-af", "spawn_main|resource_tracker|prepare.py"], capture_output=True, text=True
        ).stdout
        proc.send_signal(signal.SIGABRT)  # faulthandler prints where it waits
        stdout, stderr = proc.communicate()
        pytest.fail(f"data/prepare.py still waits for a dead worker after 120 s\n{state}\n{stderr[-5000:]}")
    assert proc.returncode == 1, stdout[-2000:] + stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("prepare.py: error: ")]
    assert len(errors) == 1 and "a tokenizer worker process died (worker " in errors[0], stderr[-2000:]
    assert "killed by SIGKILL" in errors[0]
    assert "retry with a smaller --num_proc" in errors[0]
    assert "Traceback" not in stderr, stderr[-5000:]
    assert not out.exists() and not list(tmp_path.glob(".store.tmp-*"))  # nothing half-written left
    time.sleep(1.0)
    assert not [pid for pid in seen if running(pid)], "worker processes outlived the prepare"


@pytest.mark.slow  # over 5 s: real processes (the fast tier stays under 3 minutes)
@pytest.mark.parametrize(
    "disk_size",
    [
        "1m",  # full while writing the tokens: ~1.3M tokens, 2.6 MB of uint16
        "128k",  # full before that, while saving the workers' copy of the tokenizer (265 KB)
    ],
)
def test_a_full_disk_fails_the_prepare_in_one_line_and_keeps_nothing(tmp_path, disk_size):
    corpus = write_corpus(tmp_path / "corpus.jsonl", 8_000)
    with small_tmpfs(tmp_path / "disk", disk_size) as tiny_disk:
        out = tiny_disk / "store"
        proc = subprocess.run(
            [sys.executable, str(PREPARE), *prepare_argv(corpus, out, "--num_proc", "1")],
            env=child_env(tmp_path / "cache"),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert proc.stderr.count("prepare.py: error: ") == 1 and "Traceback" not in proc.stderr
        assert f"token store {out}: the disk holding {tiny_disk} is full; nothing was kept" in proc.stderr
        assert list(tiny_disk.iterdir()) == []  # the partial store was removed: the disk is free again


@pytest.mark.slow  # over 5 s: real processes (the fast tier stays under 3 minutes)
def test_an_existing_folder_that_is_not_a_store_is_refused_and_left_alone(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl", 10)
    out = tmp_path / "my_results"
    out.mkdir()
    (out / "notes.txt").write_text("weeks of work")
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder is fine: the store takes its place

    def prepare(folder: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(PREPARE), *prepare_argv(corpus, folder, "--num_proc", "1")],
            env=child_env(tmp_path / f"cache_{folder.name}"),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    # both at once: each spends seconds importing, and they share nothing but the corpus they read
    refused, accepted = prepare(out), prepare(empty)
    refused_err, accepted_err = refused.communicate(timeout=300)[1], accepted.communicate(timeout=300)[1]
    assert refused.returncode == 2
    assert refused_err.splitlines()[0] == (
        f"prepare.py: error: {out}: exists and is not a token store (no manifest.json); nothing there was changed"
    )
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "weeks of work"
    assert accepted.returncode == 0, accepted_err[-2000:]
    assert (empty / "manifest.json").exists()


def _wait_in_thread(target, *args):
    outcome = {}

    def body():
        try:
            outcome["result"] = target(*args)
        except BaseException as err:  # noqa: BLE001 - the test inspects what the waiting rank raised
            outcome["error"] = err

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.slow  # over 5 s: real processes (the fast tier stays under 3 minutes)
@pytest.mark.parametrize("failure", ["full_disk", "bad_column"])
def test_ranks_waiting_for_the_store_stop_when_local_rank_0_fails(failure, tmp_path, tiny_disk, monkeypatch):
    """No launcher is bound to kill the waiting ranks (srun without --kill-on-bad-exit): they must stop by
    themselves, with the preparing rank's kind of error, instead of polling for a manifest that never comes."""
    from transformers import AutoTokenizer

    from scaletrain.config.cli import parse_run_config
    from scaletrain.errors import PrepareError, TokenStoreFailed, UsageError
    from scaletrain.data.preparation import ensure_token_store

    monkeypatch.setenv("SCALETRAIN_CACHE", str(tiny_disk))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    corpus = write_corpus(tmp_path / "corpus.jsonl", 8_000 if failure == "full_disk" else 10)
    column = ["--text_column", "body"] if failure == "bad_column" else []
    cfg = parse_run_config(
        [
            "--config",
            str(REPO / "ds_configs/zero2.json"),
            "--output_dir",
            str(tmp_path / "o"),
            "--validation_split_percentage",
            "0",
            "--train_file",
            str(corpus),
            *column,
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    expected = PrepareError if failure == "full_disk" else UsageError
    for attempt in (1, 2):  # the second attempt: a relaunch, once the first attempt's failure is on record
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt - 1))  # as torchrun's restart sets it
        waiter, outcome = _wait_in_thread(ensure_token_store, cfg.data, tokenizer, str(TINY), 64, 1, False)
        time.sleep(2.5)  # the waiting rank polls before the preparing rank fails ...
        assert waiter.is_alive() and not outcome, f"attempt {attempt}: the waiting rank did not wait: {outcome}"
        with pytest.raises(expected) as raised:  # ... and is not stopped by the earlier attempt's failure
            ensure_token_store(cfg.data, tokenizer, str(TINY), 64, 0, False)
        waiter.join(timeout=30)
        assert not waiter.is_alive(), "the waiting rank still polls after local rank 0 failed"
        if failure == "full_disk":
            assert isinstance(outcome.get("error"), TokenStoreFailed), outcome
            assert "local rank 0 could not prepare the token store" in str(outcome["error"])
            assert "is full; nothing was kept" in str(outcome["error"])
        else:
            assert type(outcome.get("error")) is UsageError, outcome  # exit 2 on every rank, printed by rank 0
            assert str(outcome["error"]) == str(raised.value)
        assert not list((tiny_disk / "token_stores").glob("*/manifest.json"))
        assert not list((tiny_disk / "token_stores").glob(".*.tmp-*"))


@pytest.mark.slow  # two prepares in fresh processes: ~20 s
def test_num_proc_bounds_the_tokenizer_threads(tmp_path):
    """--num_proc N tokenizes on N Rust threads: the thread pool, once started, stays, so a process that prepared
    with 2 holds exactly one thread more than one that prepared with 1."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", 2_000)
    script = (
        "import os, runpy, sys\n"
        "main = runpy.run_path(sys.argv[1])['main']\n"
        "assert main(sys.argv[2:]) == 0\n"
        "print('THREADS', len(os.listdir('/proc/self/task')))\n"
    )
    env = child_env(tmp_path / "cache")
    env.pop("TOKENIZERS_PARALLELISM")  # the test environment turns the Rust threads off; a user's does not
    env.pop("RAYON_NUM_THREADS", None)
    threads = {}
    for n in (1, 2):
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                script,
                str(PREPARE),
                *prepare_argv(corpus, tmp_path / f"store{n}", "--num_proc", str(n)),
            ],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        threads[n] = int(next(x for x in proc.stdout.splitlines() if x.startswith("THREADS")).split()[1])
    assert threads[2] - threads[1] == 1, threads

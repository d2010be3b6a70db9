"""What the tests of every wing share: the hooks (fast tests first, DeepSpeed's ops built in the background while
they run) and the session's fixtures (the compiled ops, a cache folder, the layouts' one-rank references, an
offline environment). Plain helpers (launching a run, checking it, reading its metrics) are in tests/harness.py; a
wing's own fixtures are in its folder's conftest.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import LAYOUT_CLIP, REPO, check_ok, child_env, launch, layout_flags, read_metrics


def pytest_collection_modifyitems(config, items) -> None:
    """The fast tests first, then the slow ones (each group in file order): the fast ones then run while DeepSpeed's
    ops build (`pytest_collection_finish`), and a quick failure shows before the long multi-rank runs."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)


_ops_build: dict = {}  # the build of DeepSpeed's ops: its process and the file its output goes to


def _start_ops_build() -> None:
    import tempfile

    output = tempfile.TemporaryFile(mode="w+")
    _ops_build["output"] = output
    _ops_build["process"] = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "build_ops.py")],
        cwd=REPO,
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
    )


def pytest_collection_finish(session) -> None:
    """Start building DeepSpeed's CPU ops in the background when a slow test is selected: the build (g++, minutes on
    a fresh machine, one core) then overlaps the fast tests, which run first and need no compiled op."""
    if any(item.get_closest_marker("slow") is not None for item in session.items):
        _start_ops_build()


def pytest_sessionfinish(session, exitstatus) -> None:
    process = _ops_build.get("process")
    if process is not None and process.poll() is None:  # a session that ended before any slow test ran
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def compiled_ops() -> None:
    """DeepSpeed's CPU ops (shm all-reduce, cpu_adam), built once per session (minutes on a fresh machine) before
    the first test that needs them, so that no test's time limit pays the build: started in the background once
    the session's tests are collected (`pytest_collection_finish`), waited for here.

    Every slow test gets it (`_slow_tests_get_compiled_ops`): multi-rank and offload runs are all marked slow. The
    fast tier (`-m "not slow"`: unit tests and single-rank runs, which need no compiled op) never waits for it. A
    failed build is an error of every test that needs the ops (pytest keeps a session fixture's failure), never a
    skip.
    """
    if "process" not in _ops_build:
        _start_ops_build()
    returncode = _ops_build["process"].wait(timeout=1800)
    _ops_build["output"].seek(0)
    output = _ops_build["output"].read()
    if returncode != 0:
        pytest.fail(f"scripts/build_ops.py failed (exit {returncode}):\n{output[-6000:]}", pytrace=False)


@pytest.fixture(autouse=True)
def _slow_tests_get_compiled_ops(request) -> None:
    if request.node.get_closest_marker("slow") is not None:
        request.getfixturevalue("compiled_ops")


# What a test's working directory shows of the repository: everything a command line names relative to it
# (train.py, ds_configs/, data/, recipes/, scripts/, ...), but none of a user's outputs in the checkout (runs/,
# wandb/, caches): no test reads or writes them, however a user left the checkout.
LEFT_OUT_OF_THE_VIEW = {"runs", "wandb"}


@pytest.fixture(autouse=True)
def _in_a_view_of_the_checkout(tmp_path_factory, monkeypatch) -> Path:
    """Every test runs in its own folder of links to the repository's files (not to its outputs), and so does every
    run it launches through tests.harness.launch: a default --output_dir (runs/default) lands there."""
    view = tmp_path_factory.mktemp("checkout")
    for entry in REPO.iterdir():
        if not entry.name.startswith(".") and entry.name not in LEFT_OUT_OF_THE_VIEW:
            (view / entry.name).symlink_to(entry)
    monkeypatch.chdir(view)
    return view


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_cache")


@pytest.fixture(scope="module")
def tokenizer():
    """The built-in tiny Llama's tokenizer (data/tiny-llama), one per test module (a module may set its template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REPO / "data" / "tiny-llama")


@pytest.fixture
def offline(monkeypatch, tmp_path) -> Path:
    """This process as a test's run would be (for train.py's `main` and the data preparation called in-process):
    offline, wandb offline, its caches under tmp_path/cache (child_env's HF_*, WANDB_* and SCALETRAIN_* variables),
    and datasets' module-level settings (read when datasets was imported, before the environment could say so) to
    match; in its view of the checkout, as every test. The datasets cache folder."""
    import datasets

    env = child_env(tmp_path / "cache")
    for key, value in env.items():
        if key.startswith(("HF_", "WANDB_", "SCALETRAIN_")):
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", Path(env["HF_DATASETS_CACHE"]))
    return Path(env["HF_DATASETS_CACHE"])


@pytest.fixture(scope="session")
def layout_reference(tmp_path_factory, cache_dir) -> Path:
    """One rank, ZeRO-2, the layout tests' global batch (4 blocks) and seed: the run every layout must equal. Its
    output is kept beside it (harness.reference_output()), for the tests that check what a plain run says."""
    run_dir = tmp_path_factory.mktemp("layouts") / "reference"
    proc = launch(REPO / "train.py", layout_flags(run_dir, "zero2"), "python", cache_dir)
    check_ok(proc)
    (run_dir.parent / "stdout.txt").write_text(proc.stdout)
    (run_dir.parent / "stderr.txt").write_text(proc.stderr)
    assert max(r["grad_norm"] for r in read_metrics(run_dir) if "grad_norm" in r) > LAYOUT_CLIP  # clipping acts
    return run_dir


@pytest.fixture(scope="session")
def layout_reference_zero3(tmp_path_factory, cache_dir) -> Path:
    """The same under ZeRO-3, which builds the model inside deepspeed.zero.Init: other initial weights than a plain
    build, so ZeRO-3 layouts compare against this one."""
    run_dir = tmp_path_factory.mktemp("layouts") / "reference_zero3"
    check_ok(launch(REPO / "train.py", layout_flags(run_dir, "zero3"), "python", cache_dir))
    return run_dir

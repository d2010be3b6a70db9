"""A run resumed with another LR schedule: one warning with the LR before and after, the new schedule (and peak)
followed from the resumed step on; another peak LR refused (exit 2, nothing written) unless
--allow_schedule_change. Real single-process runs of train.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from scaletrain.engine.schedules import LRSchedule, warmup_steps_for
from tests.harness import FAST_FLAGS, REPO, check_ok, launch, read_metrics

WARNING = re.compile(
    r"WARNING resumed at step (\d+) with another LR schedule .*: the LR at step \1 goes from "
    r"(\S+) to (\S+)$"
)


def _flags(run_dir: Path, max_steps: int, *extra: str) -> list:
    return [
        "--config",
        "ds_configs/zero2.json",
        "--output_dir",
        str(run_dir),
        "--max_steps",
        str(max_steps),
        "--save_steps",
        "2",
        "--no-export_hf_at_end",
        *FAST_FLAGS,
        *extra,
    ]


def _schedule(max_steps: int) -> LRSchedule:
    """The schedule of _flags(max_steps) with the defaults (cosine, --warmup_ratio 0.05, --min_lr_ratio 0.1)."""
    return LRSchedule("cosine", max_steps, warmup_steps_for(max_steps, 0, 0.05), 0.1, 0.2)


def _warnings(proc) -> list:
    """The schedule-change warnings of a run, as (step, before, after)."""
    lines = (proc.stdout + proc.stderr).splitlines()
    return [
        (int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in map(WARNING.search, lines) if m is not None
    ] + [None for line in lines if "another LR schedule" in line and not WARNING.search(line)]  # malformed ones


def _logged_lr(run_dir: Path) -> dict:
    return {r["step"]: r["lr"] for r in read_metrics(run_dir) if "loss" in r}


def _listing(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_dir) -> Path:
    """A finished 4-step run (cosine over 4 steps) with committed checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("schedule") / "finished"
    check_ok(launch(REPO / "train.py", _flags(run_dir, 4), "python", cache_dir))
    assert (run_dir / "checkpoints" / "step4").is_dir()
    return run_dir


@pytest.mark.slow  # three runs of about 10 s each on two cores
def test_a_longer_run_warns_once_and_follows_the_new_schedule(finished, tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    longer = launch(REPO / "train.py", _flags(run_dir, 8), "python", cache_dir)
    check_ok(longer)
    [(step, before, after)] = _warnings(longer)
    assert step == 4
    assert before == pytest.approx(1e-3 * _schedule(4).multiplier(4), rel=1e-2)
    assert after == pytest.approx(1e-3 * _schedule(8).multiplier(4), rel=1e-2)
    lrs = _logged_lr(run_dir)
    assert [lrs[s] for s in (6, 8)] == pytest.approx([1e-3 * _schedule(8).multiplier(s) for s in (6, 8)])
    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}

    # The same flags again, from the step-6 checkpoint the longer run wrote: no warning, the same steps 7-8.
    again = launch(
        REPO / "train.py",
        _flags(run_dir, 8, "--resume_from_checkpoint", str(run_dir / "checkpoints" / "step6")),
        "python",
        cache_dir,
    )
    check_ok(again)
    assert "resumed from" in again.stderr + again.stdout and _warnings(again) == []
    assert {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}[8] == losses[8]
    assert _logged_lr(run_dir)[8] == lrs[8]


@pytest.mark.slow  # three runs of about 10 s each on two cores
def test_another_peak_lr_is_refused_unless_allowed(finished, tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    before = _listing(run_dir)
    refused = launch(REPO / "train.py", _flags(run_dir, 8, "--learning_rate", "0.002"), "python", cache_dir)
    assert refused.returncode == 2, refused.stderr[-3000:]
    [error] = [line for line in refused.stderr.splitlines() if line.startswith("train.py: error")]
    assert "--learning_rate 0.002" in error and "0.001" in error, error
    assert "--allow_schedule_change" in refused.stderr
    assert _listing(run_dir) == before  # nothing written, nothing touched

    allowed = launch(
        REPO / "train.py",
        _flags(run_dir, 8, "--learning_rate", "0.002", "--allow_schedule_change"),
        "python",
        cache_dir,
    )
    check_ok(allowed)
    [(step, old, new)] = _warnings(allowed)
    assert step == 4
    assert old == pytest.approx(1e-3 * _schedule(4).multiplier(4), rel=1e-2)
    assert new == pytest.approx(2e-3 * _schedule(8).multiplier(4), rel=1e-2)
    lrs = _logged_lr(run_dir)  # the new peak is followed, not the one restored from the checkpoint
    assert [lrs[s] for s in (6, 8)] == pytest.approx([2e-3 * _schedule(8).multiplier(s) for s in (6, 8)])


def _resolved_ds(tmp_path, json_lr, *flags):
    """The flags and the DeepSpeed config resolved from zero2.json with optimizer.params.lr set to `json_lr`."""
    from scaletrain.config.cli import parse_run_config
    from scaletrain.config.deepspeed_json import HardwareFacts, ModelSize, load_ds_config, resolve_ds_config

    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config["optimizer"]["params"]["lr"] = json_lr
    path = tmp_path / f"zero2_lr_{json_lr}.json"
    path.write_text(json.dumps(config))
    cfg = parse_run_config(["--config", str(path), "--output_dir", str(tmp_path / "new"), *flags])
    return cfg, resolve_ds_config(
        load_ds_config(str(path)),
        engine=cfg.engine,
        optim=cfg.optim,
        explicit=cfg.explicit_flags,
        dp_world_size=1,
        hw=HardwareFacts("cpu", bf16_fast=False),
        model=ModelSize(64),
    )


def test_the_peak_is_the_lr_the_optimizer_got_even_from_the_json(tmp_path):
    """A JSON optimizer.params.lr stands where --learning_rate was not typed: run_config.json then holds the flag's
    default, ds_config.json the peak the run trained with, and that is what a resume compares and names."""
    from scaletrain.errors import UsageError
    from scaletrain.checkpoint.resume_point import check_peak_lr
    from scaletrain.checkpoint.run_folder import read_previous_run_config

    run = tmp_path / "previous"
    ckpt = run / "checkpoints" / "step4"
    ckpt.mkdir(parents=True)
    (run / "run_config.json").write_text(json.dumps({"learning_rate": 1e-3, "total_steps": 4}))
    (run / "ds_config.json").write_text(json.dumps({"optimizer": {"params": {"lr": 5e-4}}}))
    previous = read_previous_run_config(ckpt)
    assert previous["peak_lr"] == 5e-4 and previous["total_steps"] == 4

    cfg, ds = _resolved_ds(tmp_path, 5e-4)  # the same JSON again: the same peak, whatever --learning_rate says
    assert ds.peak_lr == 5e-4
    check_peak_lr(cfg, ds, previous, ckpt)
    cfg, ds = _resolved_ds(tmp_path, 2e-4)
    with pytest.raises(UsageError) as err:
        check_peak_lr(cfg, ds, previous, ckpt)
    assert f"optimizer.params.lr in {tmp_path}" in err.value.message and "0.0002" in err.value.message
    assert "0.0005" in err.value.message and "--allow_schedule_change" in err.value.hint
    cfg, ds = _resolved_ds(tmp_path, 2e-4, "--allow_schedule_change")
    check_peak_lr(cfg, ds, previous, ckpt)

    (run / "ds_config.json").unlink()  # an older run folder: the flag's value is all there is
    assert read_previous_run_config(ckpt)["peak_lr"] == 1e-3
    (run / "run_config.json").unlink()  # a checkpoint copied out of its run: nothing to compare with
    assert read_previous_run_config(ckpt) is None

"""wandb (real, offline) shows how a run ended: finished (0), failed (any other code), preempted (85)."""

import pytest

from scaletrain.observability.metrics import MetricsLogger, RunIdentity
from tests.helpers.wandb_records import run_end


@pytest.mark.parametrize("exit_code, preempted", [(0, False), (1, False), (85, True)])
def test_the_wandb_run_ends_with_the_runs_exit_code(tmp_path, monkeypatch, exit_code, preempted):
    monkeypatch.setenv("WANDB_MODE", "offline")
    metrics = MetricsLogger(str(tmp_path), True, ("wandb",), RunIdentity("end-state", {"seed": 1}))
    metrics.log({"step": 1, "loss": 2.5})
    metrics.close(exit_code)
    assert run_end(tmp_path) == (exit_code, preempted)

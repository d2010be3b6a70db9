"""Which ZeRO setting changes a resume converts, loads directly or refuses (scaletrain.checkpoint.resume.
zero_setting_change), decided from the checkpoint's train state or, for older checkpoints, its file names. The real
resumes are in tests/checkpoint/test_checkpoint.py (ZeRO-1 -> 2 directly, ZeRO-2 -> 2 with offload through a universal
checkpoint, both exact)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.checkpoint.resume import saved_zero_stage, zero_setting_change
from scaletrain.errors import UsageError

NONE, CPU = "optimizer=none,param=none", "optimizer=cpu,param=none"


def _checkpoint(folder: Path, stage: int) -> Path:
    """A checkpoint folder with the file names DeepSpeed 0.19.8 writes for `stage` on 2 ranks (empty files)."""
    folder.mkdir()
    names = {
        0: ["mp_rank_00_model_states.pt"],
        1: ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)],
        3: [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")],
    }
    for name in names[stage]:
        (folder / name).touch()
    return folder


def test_the_saved_stage_comes_from_the_train_state_or_the_file_names(tmp_path):
    assert saved_zero_stage(_checkpoint(tmp_path / "a", 3), {"zero_stage": 2}) == 2  # the record wins
    assert saved_zero_stage(_checkpoint(tmp_path / "b", 3), {}) == 3
    assert saved_zero_stage(_checkpoint(tmp_path / "c", 1), {}) == 1  # ZeRO-1 or 2: they load each other
    assert saved_zero_stage(_checkpoint(tmp_path / "d", 0), {}) is None


def test_stages_1_and_2_load_each_other_and_an_offload_change_converts(tmp_path):
    ckpt = _checkpoint(tmp_path / "c", 1)
    assert zero_setting_change(ckpt, {"zero_stage": 1, "offload": NONE}, 2, NONE) is None
    assert zero_setting_change(ckpt, {"zero_stage": 2, "offload": NONE}, 2, NONE) is None
    assert zero_setting_change(ckpt, {"zero_stage": 2, "offload": NONE}, 2, CPU) == f"offload {NONE} -> {CPU}"
    assert zero_setting_change(ckpt, {}, 2, CPU) is None  # offload not recorded (an older checkpoint): as saved


@pytest.mark.parametrize("saved, now", [(2, 3), (3, 1)])
def test_a_change_between_zero_1_2_and_zero_3_is_refused_naming_both(saved, now, tmp_path):
    ckpt = _checkpoint(tmp_path / "c", 3 if saved == 3 else 1)
    with pytest.raises(UsageError) as err:
        zero_setting_change(ckpt, {"zero_stage": saved, "offload": NONE}, now, NONE)
    message = str(err.value)
    assert f"saved with ZeRO stage {'3' if saved == 3 else '1 or 2'}, this run has stage {now}" in message
    assert "scripts/export_hf.py" in message


def test_zero_3_refuses_an_offload_change_and_stage_0_converts_neither_way(tmp_path):
    zero3 = _checkpoint(tmp_path / "z3", 3)
    assert zero_setting_change(zero3, {"zero_stage": 3, "offload": NONE}, 3, NONE) is None
    with pytest.raises(UsageError, match=f"under ZeRO-3 with {NONE}, this run has {CPU}"):
        zero_setting_change(zero3, {"zero_stage": 3, "offload": NONE}, 3, CPU)
    with pytest.raises(UsageError, match="saved with ZeRO stage 0, this run has stage 2"):
        zero_setting_change(_checkpoint(tmp_path / "z0", 0), {}, 2, NONE)
    with pytest.raises(UsageError, match="saved with ZeRO stage 2, this run has stage 0"):
        zero_setting_change(_checkpoint(tmp_path / "z2", 1), {"zero_stage": 2}, 0, NONE)
    assert zero_setting_change(_checkpoint(tmp_path / "z0b", 0), {}, 0, NONE) is None

"""What a run folder records of its configuration: run_config.json (every flag, the block size and the schedule's
length), ds_config.json (the resolved DeepSpeed JSON), config_sources.txt (where each value came from) and
model_config.json (the model's configuration as transformers saves it, export or not). Written once the run is
built; read back by the next run that resumes one of its checkpoints, by the export, and by --plan_calibration."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from scaletrain.config import ResolvedDSConfig, RunConfig, explain_resolved
from scaletrain.parts import DistInfo

log = logging.getLogger(__name__)
RUN_CONFIG_FILE = "run_config.json"
DS_CONFIG_FILE = "ds_config.json"
EXPLAINED_FILE = "config_sources.txt"  # the same text --print_config prints
MODEL_CONFIG_FILE = "model_config.json"  # not config.json: the folder is no Hugging Face model until it is exported


def write_run_folder(
    cfg: RunConfig,
    *,
    ds: ResolvedDSConfig,
    dist: DistInfo,
    block_size: int,
    n_params: int,
    schedule_facts: dict,
    model_config,
) -> None:
    """Save the resolved configs beside the run's outputs (rank 0), so the run can be read back and repeated.
    `schedule_facts`: what the build decided besides the flags (total and warmup steps); `model_config`: the model's
    transformers configuration."""
    if not dist.is_main:
        return
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    facts = {"world_size": dist.world_size, "precision": ds.precision}
    run_config = {**cfg.to_dict(), "block_size": block_size, **schedule_facts, **facts}
    (out / RUN_CONFIG_FILE).write_text(json.dumps(run_config, indent=2) + "\n")
    (out / DS_CONFIG_FILE).write_text(json.dumps(ds.config, indent=2) + "\n")
    explained = explain_resolved(cfg, ds=ds, block_size=block_size, n_params=n_params, dp_world_size=dist.layout.dp)
    (out / EXPLAINED_FILE).write_text(explained + "\n")
    model_config.to_json_file(str(out / MODEL_CONFIG_FILE))


def read_run_config(output_dir: str) -> dict:
    return json.loads((Path(output_dir) / RUN_CONFIG_FILE).read_text())


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        log.warning("%s: unreadable (%s); a changed LR schedule cannot be checked on this resume", path, err)
        return None


def read_previous_run_config(resume_from: Path) -> dict | None:
    """run_config.json of the run that wrote the checkpoint (its run folder, <run>/checkpoints/stepN), read before
    this run rewrites it, with "peak_lr": the LR its optimizer got (ds_config.json's optimizer.params.lr, which an
    explicit JSON value sets instead of --learning_rate). None for a checkpoint copied out of its run folder."""
    folder = resume_from.resolve().parent.parent
    run_config = _read_json(folder / RUN_CONFIG_FILE)
    if run_config is None:
        return None
    lr = ((_read_json(folder / DS_CONFIG_FILE) or {}).get("optimizer") or {}).get("params", {}).get("lr")
    peak = lr if isinstance(lr, (int, float)) else run_config.get("learning_rate")
    return {**run_config, "peak_lr": peak}

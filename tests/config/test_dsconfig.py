"""DeepSpeed JSON resolution: every "auto" filled, with its source; precision; contradictions."""

import json

import pytest

from scaletrain.errors import UsageError
from scaletrain.config.cli import parse_run_config
from scaletrain.config.deepspeed_json import (
    HardwareFacts,
    ModelSize,
    ResolvedDSConfig,
    load_ds_config,
    resolve_ds_config,
)
from tests.harness import REPO

CPU = HardwareFacts("cpu", bf16_fast=False)
H100 = HardwareFacts("cuda", bf16_fast=True)
CONFIGS = ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_nvme"]


def cfg_for(tmp_path, *flags):
    return parse_run_config(
        ["--config", str(REPO / "ds_configs/zero3.json"), "--output_dir", str(tmp_path / "o"), *flags]
    )


def resolve(raw, cfg, dp_world_size, hidden_size, hw):
    """The resolver gets the engine and optimisation slices and the flags the user set, as preflight passes them."""
    return resolve_ds_config(
        raw,
        engine=cfg.engine,
        optim=cfg.optim,
        explicit=cfg.explicit_flags,
        dp_world_size=dp_world_size,
        hw=hw,
        model=ModelSize(hidden_size),
    )


def contains_auto(tree) -> bool:
    if isinstance(tree, dict):
        return any(contains_auto(v) for v in tree.values())
    return tree == "auto"


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_resolves_completely(name, tmp_path):
    raw = load_ds_config(str(REPO / "ds_configs" / f"{name}.json"))
    cfg = cfg_for(
        tmp_path,
        "--per_device_train_batch_size",
        "3",
        "--gradient_accumulation_steps",
        "5",
        "--learning_rate",
        "2e-4",
        "--nvme_path",
        str(tmp_path),
    )
    resolved = resolve(raw, cfg, dp_world_size=4, hidden_size=64, hw=CPU)
    c = resolved.config
    assert not contains_auto(c)
    assert c["train_batch_size"] == 3 * 5 * 4
    assert c["optimizer"]["params"]["lr"] == 2e-4
    # the bucket rule on a CPU in fp32: 1 ms x 1.2 GB/s x 9 / 4 bytes (no model size given: no cap by it)
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
        assert c["zero_optimization"][key] == 2_700_000, key
    assert resolved.sources["train_batch_size"] == "micro batch 3 x accumulation 5 x data-parallel size 4"
    assert "--learning_rate" in resolved.explained()
    assert resolved.precision == "fp32" and not c["bf16"]["enabled"] and not c["fp16"]["enabled"]
    # torch AdamW on CPU only where no optimizer offload needs DeepSpeedCPUAdam
    assert c["optimizer"]["params"].get("torch_adam", False) == (not resolved.offloads_optimizer)
    # a run's saved ds_config.json reads back as the resolved one (calibration and --plan_calibration read it)
    saved = ResolvedDSConfig.saved(json.loads(json.dumps(c)), "ds_config.json")
    assert (saved.precision, saved.zero_stage, saved.offload_setting) == (
        resolved.precision, resolved.zero_stage, resolved.offload_setting,
    )  # fmt: skip
    assert saved.offload_devices == {
        "zero1": ("none", "none"), "zero2": ("none", "none"), "zero3": ("none", "none"),
        "zero2_offload": ("cpu", "none"), "zero3_offload": ("cpu", "cpu"), "zero3_nvme": ("nvme", "nvme"),
    }[name]  # fmt: skip
    bf16 = ResolvedDSConfig.saved({**c, "bf16": {"enabled": True}}, "ds_config.json")
    assert bf16.precision == "bf16"


def test_precision_auto_is_bf16_on_a_bf16_gpu_and_flags_win(tmp_path):
    raw = load_ds_config(str(REPO / "ds_configs/zero2.json"))
    assert resolve(raw, cfg_for(tmp_path), 1, 64, H100).precision == "bf16"
    fp16 = resolve(raw, cfg_for(tmp_path, "--fp16"), 1, 64, H100)
    assert fp16.precision == "fp16" and fp16.config["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert not fp16.config["bf16"]["enabled"]
    assert "optimizer.params.torch_adam" not in fp16.sources  # GPUs keep DeepSpeed's fused Adam


def test_fp16_on_a_cpu_is_refused_before_anything_is_built(tmp_path):
    raw = load_ds_config(str(REPO / "ds_configs/zero2.json"))
    with pytest.raises(UsageError, match="^--fp16: fp16 training needs a GPU"):
        resolve(raw, cfg_for(tmp_path, "--fp16"), 1, 64, CPU)
    raw["fp16"]["enabled"] = True
    with pytest.raises(UsageError, match=r"^fp16.enabled=true in .*\.json: fp16 training needs a GPU"):
        resolve(raw, cfg_for(tmp_path), 1, 64, CPU)
    assert resolve(raw, cfg_for(tmp_path), 1, 64, H100).precision == "fp16"


def test_explicit_json_value_is_kept_and_contradiction_is_explained(tmp_path):
    raw = load_ds_config(str(REPO / "ds_configs/zero2.json"))
    raw["train_batch_size"] = 100
    expected = r"train_batch_size 100 .* micro batch 8 x accumulation 1 x data-parallel size 2 = 16"
    with pytest.raises(UsageError, match=expected):
        resolve(raw, cfg_for(tmp_path), 2, 64, CPU)
    raw = load_ds_config(str(REPO / "ds_configs/zero2.json"))
    raw["bf16"]["enabled"] = True
    with pytest.raises(UsageError, match="--fp16 contradicts bf16.enabled=true"):
        resolve(raw, cfg_for(tmp_path, "--fp16"), 1, 64, CPU)
    raw["fp16"]["enabled"] = True
    with pytest.raises(UsageError, match="both true"):
        resolve(raw, cfg_for(tmp_path), 1, 64, CPU)


def test_nvme_path_comes_from_flag_or_env_or_fails_clearly(tmp_path, monkeypatch):
    raw = load_ds_config(str(REPO / "ds_configs/zero3_nvme.json"))
    monkeypatch.delenv("SCALETRAIN_NVME_PATH", raising=False)
    with pytest.raises(UsageError, match="nvme_path .* no NVMe folder was given") as err:
        resolve(raw, cfg_for(tmp_path), 1, 64, CPU)
    assert "--nvme_path" in err.value.hint
    monkeypatch.setenv("SCALETRAIN_NVME_PATH", "/no/such/nvme")
    with pytest.raises(UsageError, match="NVMe folder /no/such/nvme .* does not exist"):
        resolve(raw, cfg_for(tmp_path), 1, 64, CPU)
    monkeypatch.setenv("SCALETRAIN_NVME_PATH", str(tmp_path))
    resolved = resolve(raw, cfg_for(tmp_path), 1, 64, CPU)
    assert resolved.config["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path)
    assert resolved.sources["zero_optimization.offload_param.nvme_path"] == "$SCALETRAIN_NVME_PATH"


def test_bucket_sizes_amortise_a_collectives_latency_bounded_by_the_model_and_memory():
    from scaletrain.config.deepspeed_json import LINKS, MAX_BUCKET_ELEMENTS, bucket_elements

    for accelerator, precision, element_bytes in (("cuda", "bf16", 2), ("cuda", "fp32", 4), ("cpu", "fp32", 4)):
        elements, why = bucket_elements(accelerator, precision, None)
        link = LINKS[accelerator]
        transfer = elements * element_bytes / link.bandwidth_bytes_per_s
        assert link.latency_s / (link.latency_s + transfer) == pytest.approx(0.10, rel=1e-3), accelerator
        assert f"({accelerator} link, latency <= 10%)" in why
    assert bucket_elements("cuda", "bf16", None)[0] == 101_250_000  # 200 MB: about the Trainer docs' 2e8 elements
    assert bucket_elements("cuda", "bf16", 5_000_000) == (
        5_000_000,
        "50 us x 450 GB/s x 9 (cuda link, latency <= 10%) / 2 bytes = 101250000, capped at the model (5000000)",
    )
    assert bucket_elements("cuda", "bf16", 10**12)[0] <= MAX_BUCKET_ELEMENTS


def test_unresolvable_auto_and_scheduler_section_are_refused(tmp_path):
    raw = load_ds_config(str(REPO / "ds_configs/zero2.json"))
    raw["zero_optimization"]["stage3_max_live_parameters"] = "auto"
    with pytest.raises(UsageError, match="zero_optimization.stage3_max_live_parameters"):
        resolve(raw, cfg_for(tmp_path), 1, 64, CPU)
    raw = load_ds_config(str(REPO / "ds_configs/zero2.json"))
    raw["scheduler"] = {"type": "WarmupLR"}
    with pytest.raises(UsageError, match="scheduler"):
        resolve(raw, cfg_for(tmp_path), 1, 64, CPU)


def test_unreadable_or_invalid_json_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": ')
    with pytest.raises(UsageError, match=f"--config {bad}: not valid JSON"):
        load_ds_config(str(bad))
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(UsageError, match="JSON object"):
        load_ds_config(str(bad))


def test_bf16_disabled_in_the_json_trains_fp32_on_a_bf16_gpu(tmp_path):
    """The only way to train fp32 on a bf16 GPU (the GPU check's loss reference): "auto" would pick bf16."""
    raw = load_ds_config(str(REPO / "ds_configs/zero2.json"))
    raw["bf16"]["enabled"] = False
    resolved = resolve(raw, cfg_for(tmp_path), 1, 64, H100)
    assert resolved.precision == "fp32" and not resolved.config["bf16"]["enabled"]
    assert not resolved.config["fp16"]["enabled"] and "bf16.enabled=false" in resolved.precision_reason
    assert resolve(raw, cfg_for(tmp_path, "--bf16"), 1, 64, H100).precision == "bf16"  # the flag still wins


def test_the_deepspeed_config_is_assembled_once_from_ordered_contributions_each_with_its_source(tmp_path):
    """The filled JSON, then the layout's keys, then the resume's: every key says where it came from, the filled
    config is left as it was, and two concerns writing one key is refused."""
    from scaletrain.config import DSKey, assemble_ds_config

    cfg = cfg_for(tmp_path)
    path = cfg.engine.config
    filled = resolve(load_ds_config(path), cfg, dp_world_size=2, hidden_size=64, hw=CPU)
    layout = (
        DSKey("tensor_parallel.autotp_size", 2, "--tensor_parallel_size"),
        DSKey("tensor_parallel.vocab_parallel_lm_head", False, "tensor parallelism: the loss reads whole logits"),
    )
    resume = (DSKey("checkpoint.load_universal", True, "resume of a checkpoint from 4 data-parallel ranks"),)
    ds = assemble_ds_config(filled, layout, resume)
    assert ds.config["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}
    assert ds.config["checkpoint"]["load_universal"] is True
    assert "tensor_parallel" not in filled.config and "checkpoint" not in filled.config
    assert ds.sources["tensor_parallel.autotp_size"] == "--tensor_parallel_size"
    assert ds.sources["checkpoint.load_universal"].startswith("resume of a checkpoint")
    assert ds.sources["train_batch_size"] == filled.sources["train_batch_size"]  # the fill's sources kept
    explained = ds.explained()
    decided, written = explained.split(f"as written in {path}:")
    assert "  tensor_parallel.autotp_size = 2  <- --tensor_parallel_size" in decided
    assert "  zero_optimization.stage = 3\n" in written  # taken from the file as it stands
    every_leaf = [line for line in explained.splitlines() if line.startswith("  ") and " = " in line]
    named = {line.split(" = ")[0].strip() for line in every_leaf}
    assert {"train_batch_size", "zero_optimization.stage", "checkpoint.load_universal", "optimizer.type"} <= named
    with pytest.raises(AssertionError, match="tensor_parallel.autotp_size: set by --tensor_parallel_size and"):
        assemble_ds_config(filled, layout, (DSKey("tensor_parallel.autotp_size", 4, "another concern"),))


def test_nothing_is_credited_to_the_json_that_it_did_not_write(tmp_path):
    """A default the pipeline adds has its source (ZeRO stage 0 where the JSON names none), and a key taken out again
    (a resume fallback's checkpoint.load_universal) leaves no empty section behind."""
    from scaletrain.config import DSKey, assemble_ds_config

    cfg = cfg_for(tmp_path)
    raw = {k: v for k, v in load_ds_config(cfg.engine.config).items() if k != "zero_optimization"}
    filled = resolve(raw, cfg, dp_world_size=1, hidden_size=64, hw=CPU)
    assert filled.zero_stage == 0 and filled.sources["zero_optimization.stage"].startswith("default: no ZeRO")
    universal = assemble_ds_config(filled, (DSKey("checkpoint.load_universal", True, "a resume"),))
    assert universal.without("checkpoint.load_universal").config == filled.config
    assert "checkpoint" not in universal.without("checkpoint.load_universal").explained()

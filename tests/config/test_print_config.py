"""--print_config: every value resolved, with its source, printed; nothing built or written."""

import json

from tests.harness import REPO


def test_print_config_explains_every_value_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from train import main

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    code = main(
        [
            "--config",
            "ds_configs/zero3_offload.json",
            "--output_dir",
            str(out),
            "--print_config",
            "--per_device_train_batch_size",
            "3",
            "--gradient_accumulation_steps",
            "2",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert not out.exists()
    assert "per_device_train_batch_size = 3  <- --per_device_train_batch_size" in printed
    assert "learning_rate = 0.001  <- default" in printed
    assert "train_batch_size = 6  <- micro batch 3 x accumulation 2 x data-parallel size 1" in printed
    # the bucket rule, capped by the tiny model's parameter count
    assert (
        "zero_optimization.reduce_bucket_size = 1787008  <- 1000 us x 1.2 GB/s x 9 (cpu link, latency <= 10%) "
        "/ 4 bytes = 2700000, capped at the model (1787008)"
    ) in printed
    assert "precision fp32 (auto: no fast bf16" in printed
    resolved = json.loads(printed[printed.index("{") : printed.index("where the decided values came from")])
    assert resolved["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "auto" not in json.dumps(resolved)

"""--attn_implementation left unset is transformers' own choice for the model (sdpa where the model has it, eager
otherwise), said in the first lines and used by the real build; a backend the user names that the model lacks is
still refused in one line; and documents packed for isolation are refused on a model that cannot keep them apart.
BLOOM is the model without an sdpa path (and without position ids)."""

from __future__ import annotations

import pytest

from tests.harness import REPO, check_ok, launch, reference_output
from tests.core.test_bad_input import assert_refused

ZERO2 = str(REPO / "ds_configs" / "zero2.json")
TINY = str(REPO / "data" / "tiny-llama")


@pytest.fixture
def bloom(tmp_path):
    from transformers import AutoTokenizer, BloomConfig

    folder = tmp_path / "bloom"
    vocab = len(AutoTokenizer.from_pretrained(TINY))
    BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=vocab).save_pretrained(folder)
    return ["--config_name", str(folder), "--tokenizer_name", TINY]


@pytest.mark.slow  # two dry runs, ~10 s each, and the layout tests' shared 1-rank run
def test_a_model_without_sdpa_trains_with_transformers_choice_and_says_so(bloom, layout_reference, tmp_path, cache_dir):
    flags = ["--config", ZERO2, "--dry_run", "--block_size", "64", "--per_device_train_batch_size", "2"]
    proc = launch(REPO / "train.py", [*flags, *bloom, "--output_dir", str(tmp_path / "bloom_run")], "python", cache_dir)
    check_ok(proc)
    assert "attention: eager (transformers' choice for bloom)" in proc.stdout, proc.stdout[-3000:]
    assert "dry run OK" in proc.stdout
    # The tiny Llama with --attn_implementation unset: the layout tests' shared run (ZeRO-2, one rank) says it
    llama_stdout, _ = reference_output(layout_reference)
    assert "attention: sdpa (transformers' choice for llama)" in llama_stdout, llama_stdout[-3000:]
    named = launch(
        REPO / "train.py",
        [*flags, "--attn_implementation", "eager", "--output_dir", str(tmp_path / "named")],
        "python",
        cache_dir,
    )
    check_ok(named)
    assert "attention: eager (--attn_implementation)" in named.stdout


@pytest.mark.usefixtures("offline")
def test_a_named_backend_the_model_lacks_is_one_line(bloom, tmp_path, capsys):
    out = tmp_path / "out"
    assert_refused(
        "sdpa on bloom",
        ["--config", ZERO2, *bloom, "--attn_implementation", "sdpa", "--output_dir", str(out)],
        out,
        capsys,
        "--attn_implementation",
        "BloomForCausalLM does not support",
        "drop --attn_implementation to let transformers choose for this model (sdpa where the model has it, eager "
        "otherwise), or install the backend's package",
    )


@pytest.mark.usefixtures("offline")
def test_isolation_on_a_model_without_position_ids_is_refused(bloom, tmp_path, capsys):
    out = tmp_path / "out"
    assert_refused(
        "isolation on bloom",
        ["--config", ZERO2, *bloom, "--attention_isolation", "--output_dir", str(out)],
        out,
        capsys,
        "--attention_isolation",
        "BloomForCausalLM takes no position_ids, so packed documents cannot be kept apart",
    )

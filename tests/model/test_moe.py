"""Mixture-of-experts models: the router's load-balancing loss and ZeRO-3 leaf modules (scaletrain/model/moe.py).

In-process, a tiny Mixtral (hidden 32, 2 layers, 4 experts, top-2, the repo's tiny tokenizer): our objective
(summed cross-entropy x 1 / targets + coef x aux, the loop's scaling at one micro-batch and one rank) equals
transformers' own `loss` with `labels` (token-mean CE + coef x aux), gradients included, through the chunked head;
padded positions stay out of the router statistics. Real 2-rank runs (gloo, fp32): ZeRO-3 and ZeRO-2 on 2 ranks x
micro-batch 2 against 1 rank x micro-batch 2 x 2 accumulation steps (the same micro-batches: the aux loss is a
per-micro-batch statistic, so 1 rank x micro-batch 4 would be another objective), per-step loss, aux_loss and
gradient norm within 1e-5 / 1e-4, with a coefficient large enough that a wrong aux factor moves them.
"""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import pytest
import torch

from scaletrain.data.blocks import IGNORE_INDEX
from scaletrain.model.chunked_loss import install_chunked_loss
from scaletrain.config.slices import ModelArgs, ParallelArgs
from scaletrain.errors import UsageError
from scaletrain.train.losses import token_and_router_losses
from scaletrain.model.moe import SPARSE_MOE_BLOCKS, expert_count, resolve_router_loss
from tests.harness import FAST_FLAGS, REPO, check_ok, launch, read_metrics

TINY = REPO / "data" / "tiny-llama"
COEF = 0.5  # well above Mixtral's 0.001, so that the aux term shows in the numbers compared


def tiny_mixtral_config(**overrides):
    from transformers import AutoTokenizer, MixtralConfig

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    values = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.02,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return MixtralConfig(**{**values, **overrides})


def tiny_mixtral_folder(folder: Path) -> Path:
    """A model folder as data/tiny-llama is: a Mixtral config.json and the tiny tokenizer, no weights."""
    tiny_mixtral_config().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder / name)
    return folder


def _router_loss(config, coef=None):
    from transformers import MixtralForCausalLM

    with torch.device("meta"):
        skeleton = MixtralForCausalLM(config)
    return resolve_router_loss(ModelArgs(router_aux_loss_coef=coef), ParallelArgs(), config, skeleton)


class _Bare:
    """What token_and_router_losses reads of an engine, for a plain module in-process: the call, .module, .device."""

    def __init__(self, module):
        self.module, self.device = module, torch.device("cpu")

    def __call__(self, **kwargs):
        return self.module(**kwargs)


def _batch(padded: int = 0) -> dict:
    torch.manual_seed(1)
    input_ids = torch.randint(3, 500, (3, 24))
    labels = input_ids.clone()
    if padded:
        input_ids[2, -padded:] = 2  # right padding of the run's last block, as blocks.py makes it
        labels[2, -padded:] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


def test_aux_loss_and_gradients_equal_transformers_own_loss():
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    config = tiny_mixtral_config()
    hf = MixtralForCausalLM(config).train()
    ours = copy.deepcopy(hf)
    install_chunked_loss(ours, 16)
    router = _router_loss(config)
    assert router.coef == 0.02 and (router.num_experts, router.top_k) == (4, 2)
    batch = _batch()
    out = hf(input_ids=batch["input_ids"], labels=batch["labels"], output_router_logits=True)
    summed, aux = token_and_router_losses(_Bare(ours), batch, router)
    targets = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert aux.item() == pytest.approx(out.aux_loss.item(), rel=1e-6)  # transformers' load_balancing_loss_func
    assert 1.0 < aux.item() < 4.0  # top-2 of 4 experts: 2 when balanced, more when not
    # the loop's backward value at one rank and one micro-batch: loss_sum x 1 / targets + coef x aux / 1
    objective = summed / targets + router.coef * aux
    assert objective.item() == pytest.approx(out.loss.item(), rel=1e-6)
    out.loss.backward()
    objective.backward()
    for (name, p), (_, q) in zip(hf.named_parameters(), ours.named_parameters(), strict=True):
        assert (p.grad - q.grad).norm() <= 1e-5 * p.grad.norm() + 1e-12, name
    # the aux term does reach the routers: without it their gradient is another one
    router_weight = "model.layers.0.mlp.gate.weight"
    ce_only = copy.deepcopy(hf)
    ce_only.zero_grad()
    ce_only(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    grads = dict(hf.named_parameters())[router_weight].grad, dict(ce_only.named_parameters())[router_weight].grad
    assert (grads[0] - grads[1]).norm() > 1e-3 * grads[0].norm()


def test_padded_positions_stay_out_of_the_router_statistics():
    from transformers import MixtralForCausalLM
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    config = tiny_mixtral_config()
    model = MixtralForCausalLM(config)
    router = _router_loss(config)
    batch = _batch(padded=10)
    with torch.no_grad():
        _, aux = token_and_router_losses(_Bare(model), batch, router)
        out = model(input_ids=batch["input_ids"], output_router_logits=True)
    real = (batch["labels"] != IGNORE_INDEX).long()
    assert aux.item() == pytest.approx(load_balancing_loss_func(out.router_logits, 4, 2, real).item(), rel=1e-6)
    assert abs(aux.item() - out.aux_loss.item()) > 1e-4  # the model's own value counts the padding


def test_moe_models_are_known_by_their_config_and_dense_ones_are_not():
    from transformers import AutoConfig, Qwen2MoeConfig, Qwen3MoeConfig

    assert expert_count(tiny_mixtral_config()) == 4
    assert expert_count(Qwen3MoeConfig(num_experts=8)) == 8
    assert expert_count(Qwen2MoeConfig(num_experts=6)) == 6
    assert expert_count(AutoConfig.from_pretrained(TINY)) is None
    assert set(SPARSE_MOE_BLOCKS) == {"mixtral", "qwen2_moe", "qwen3_moe"}
    assert _router_loss(tiny_mixtral_config(), coef=0.0) is None  # 0: no load-balancing loss
    assert _router_loss(tiny_mixtral_config(), coef=0.3).coef == 0.3  # the flag wins over the config's 0.02


def test_qwen3_moe_blocks_are_found_and_its_aux_loss_is_its_own():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=600,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.01,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    router = resolve_router_loss(ModelArgs(), ParallelArgs(), config, model)
    batch = _batch()
    with torch.no_grad():
        _, aux = token_and_router_losses(_Bare(model), batch, router)
        out = model(input_ids=batch["input_ids"], output_router_logits=True)
    assert aux.item() == pytest.approx(out.aux_loss.item(), rel=1e-6)


def test_what_is_refused_before_anything_is_built():
    from transformers import MixtralForCausalLM

    config = tiny_mixtral_config()
    with torch.device("meta"):
        skeleton = MixtralForCausalLM(config)
    for flag in ("pipeline_parallel_size", "tensor_parallel_size", "sequence_parallel_size"):
        with pytest.raises(UsageError, match=f"--{flag} 2 with a mixture-of-experts model"):
            resolve_router_loss(ModelArgs(), ParallelArgs(**{flag: 2}), config, skeleton)
    unknown = copy.deepcopy(config)
    unknown.model_type = "not_in_the_table"
    with pytest.raises(UsageError, match="no known sparse-MoE block"):
        resolve_router_loss(ModelArgs(), ParallelArgs(), unknown, skeleton)


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--router_aux_loss_coef", "-1"], "--router_aux_loss_coef -1.0: must not be negative"),
        pytest.param(  # the model is read to know: ~10 s of real processes, in the slow tier
            ["--router_aux_loss_coef", "0.01"],
            "--router_aux_loss_coef 0.01: LlamaForCausalLM (model_type llama) is not a mixture-of-experts model",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_bad_flag_is_one_line_exit_2(flags, expected, tmp_path, cache_dir):
    proc = launch(REPO / "train.py", ["--output_dir", str(tmp_path / "out"), *flags], "python", cache_dir, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == f"train.py: error: {expected}", lines
    assert len(lines) <= 2 and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


# --- real runs ------------------------------------------------------------------------------------------------

STEPS = 4


def _run(run_dir: Path, folder: Path, config: str, nprocs: int, cache: Path, *extra: str):
    flags = [
        "--config_name",
        str(folder),
        "--config",
        f"ds_configs/{config}.json",
        "--output_dir",
        str(run_dir),
        "--max_steps",
        str(STEPS),
        *FAST_FLAGS,
        "--logging_steps",
        "1",
        "--per_device_train_batch_size",
        "2",
        "--router_aux_loss_coef",
        str(COEF),
        "--no-export_hf_at_end",
        *extra,
    ]
    proc = launch(REPO / "train.py", flags, "deepspeed" if nprocs > 1 else "python", cache, nprocs=nprocs, timeout=300)
    check_ok(proc)
    return proc, {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.slow  # a 1-rank and a 2-rank run of 4 steps each
@pytest.mark.parametrize("config", ["zero3"])  # the case; ZeRO-2 was dropped to keep CI in its budget
def test_two_ranks_train_a_mixtral_as_one_rank_does(config, tmp_path, cache_dir):
    folder = tiny_mixtral_folder(tmp_path / "tiny-mixtral")
    proc, two = _run(tmp_path / "two", folder, config, 2, cache_dir)
    _, one = _run(tmp_path / "one", folder, config, 1, cache_dir, "--gradient_accumulation_steps", "2")
    output = proc.stdout + proc.stderr
    if config == "zero3":
        assert "ZeRO-3 leaf modules: 2 x MixtralSparseMoeBlock" in output
    assert "load-balancing loss x 0.5 (from --router_aux_loss_coef)" in output
    assert sorted(two) == list(range(1, STEPS + 1))
    for step in two:
        assert math.isfinite(two[step]["aux_loss"]) and 1.0 < two[step]["aux_loss"] < 4.0, two[step]
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-5), step
        assert two[step]["aux_loss"] == pytest.approx(one[step]["aux_loss"], rel=1e-5), step
        assert two[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-4), step
    assert f"aux_loss={two[1]['aux_loss']:.4g}" in output  # in the log line too
    final_eval = read_metrics(tmp_path / "two")[-1]
    assert "eval_loss" in final_eval and "aux_loss" not in final_eval  # evaluation reports cross-entropy

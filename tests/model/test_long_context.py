"""The long-sequence memory features (ALST's recipe): --tiled_mlp and --activation_offloading.

In-process on the tiny Llama (fp32): the tiled MLP gives the same loss and gradients as the dense one (1e-5), with
and without gradient checkpointing, and with activation offloading, which also leaves no checkpointed layer's input
alive on the device side; a mixture-of-experts MLP is refused by name. Real runs of train.py: the features together
on one rank (ZeRO-2) and under sequence parallelism with ZeRO-3, against the layout tests' one-rank references.
"""

from __future__ import annotations

import gc
import shutil
import weakref
import pytest

from scaletrain.config.slices import ModelArgs
from scaletrain.errors import UsageError
from scaletrain.model.activation_offload import install_activation_offloading
from scaletrain.model.tiled_mlp import check_tiled_mlp, install_tiled_mlp, tile_count
from tests.harness import REPO, check_ok, launch, layout_flags
from tests.distributed.test_tensor_parallel import _assert_matches


def _tiny_llama(checkpointing: bool = False):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(REPO / "data" / "tiny-llama")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _loss_and_grads(model, tokens):
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def dense():
    import torch

    tokens = torch.randint(0, 4096, (2, 96), generator=torch.Generator().manual_seed(1))
    return tokens, _loss_and_grads(_tiny_llama(), tokens)


def _assert_same(got, expected) -> None:
    loss, grads = got
    assert loss == pytest.approx(expected[0], rel=1e-5)
    for name, grad in expected[1].items():
        assert float((grads[name] - grad).norm() / grad.norm()) < 1e-5, name


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_tiled_mlp_gives_the_dense_losses_and_gradients(dense, checkpointing):
    import torch

    tokens, expected = dense
    model = _tiny_llama(checkpointing)
    install_tiled_mlp(model, shards=5)  # 96 tokens in 5 uneven slices
    sizes = []
    mlp = model.model.layers[0].mlp
    mlp.up_proj.register_forward_hook(lambda module, args, out: sizes.append(out.numel() // out.shape[-1]))
    _assert_same(_loss_and_grads(model, tokens), expected)
    # the intermediates exist for one slice of the 2 x 96 tokens at a time (forward, then again in the backward)
    assert sizes and max(sizes) <= 40 and sum(sizes) % 192 == 0
    with torch.no_grad():  # evaluation tiles too
        assert float(model(input_ids=tokens, labels=tokens).loss) == pytest.approx(expected[0], rel=1e-5)


def test_activation_offloading_keeps_the_checkpointed_inputs_off_the_device(dense):
    tokens, expected = dense
    model = _tiny_llama(checkpointing=True)
    offload = install_activation_offloading(model)
    inputs = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: inputs.append(weakref.ref(args[0])))
    loss = model(input_ids=tokens, labels=tokens).loss
    gc.collect()
    # each layer's input was copied to host memory once ([2, 96, 128] fp32, 4 layers), and the tensor the layer
    # got is gone before the backward (the last one is the final norm's input, held by the norm itself)
    assert offload.offloaded_bytes == 4 * 2 * 96 * 128 * 4
    assert [ref() is None for ref in inputs[:-1]] == [True] * 3
    loss.backward()
    _assert_same((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}), expected)


def test_tiled_mlp_and_offloading_together(dense):
    tokens, expected = dense
    model = _tiny_llama(checkpointing=True)
    install_tiled_mlp(model, shards=0)  # the default: ceil(96 / 128) = 1 slice, the dense forward
    install_tiled_mlp(model, shards=3)
    install_activation_offloading(model)
    _assert_same(_loss_and_grads(model, tokens), expected)


def test_the_tiled_mlp_trains_a_lora_adapter_as_the_dense_one():
    """LoRA on every linear layer of a frozen base: only the adapter's weights get gradients, the same with tiles."""
    import torch
    from peft import LoraConfig, get_peft_model

    tokens = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(2))
    results = []
    for tiled in (False, True):
        model = _tiny_llama(checkpointing=True)
        model.enable_input_require_grads()
        adapter = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, adapter)
        if tiled:
            install_tiled_mlp(model, shards=4)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    assert any("mlp" in name for name in results[0][1])  # the MLP's adapters are among the trained weights
    _assert_same(results[1], results[0])


def test_slices_follow_alst_unless_given():
    assert tile_count(tokens=16384, hidden=4096, shards=0) == 4
    assert tile_count(tokens=1000, hidden=4096, shards=0) == 1
    assert tile_count(tokens=10, hidden=4096, shards=64) == 10  # never an empty slice
    assert tile_count(tokens=16384, hidden=4096, shards=7) == 7


def test_a_mixture_of_experts_mlp_is_refused_by_name():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=256,
    )  # fmt: skip
    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UsageError, match=r"--tiled_mlp: model.layers.0.mlp is a Qwen2MoeSparseMoeBlock"):
        check_tiled_mlp(moe)
    with torch.device("meta"):
        assert check_tiled_mlp(_tiny_llama()) == 4


@pytest.mark.parametrize(
    "args,message",
    [
        ({"activation_offloading": True}, "--activation_offloading without --gradient_checkpointing"),
        ({"tiled_mlp_shards": 4}, "--tiled_mlp_shards 4: given without --tiled_mlp"),
        ({"tiled_mlp": True, "tiled_mlp_shards": -1}, "--tiled_mlp_shards -1: must not be negative"),
    ],
)
def test_bad_flags_are_refused(args, message):
    with pytest.raises(UsageError, match=message):
        ModelArgs(**args).validate()


# --- real engines ------------------------------------------------------------------------------------------------

FEATURES = ["--tiled_mlp", "--tiled_mlp_shards", "4", "--gradient_checkpointing", "--activation_offloading"]


@pytest.mark.slow  # two 1-rank runs and a 2-rank run of 8 steps (the references are the layout tests')
def test_the_memory_features_train_as_the_reference(layout_reference, layout_reference_zero3, tmp_path, cache_dir):
    """Every feature on, on one rank under ZeRO-2 (then resumed from its step-4 checkpoint) and under sequence
    parallelism 2 with ZeRO-3: losses and gradient norms equal to the plain runs'."""
    one_rank = tmp_path / "one_rank"
    proc = launch(REPO / "train.py", layout_flags(one_rank, "zero2", *FEATURES), "python", cache_dir)
    check_ok(proc)
    assert "tiled MLP: 4 MLPs computed in 4 slices" in proc.stderr + proc.stdout
    assert "activation offloading: the inputs of 4 checkpointed layers" in proc.stderr + proc.stdout
    _assert_matches(one_rank, layout_reference)
    resumed = tmp_path / "resumed"  # from the step-4 checkpoint, with the features: steps 5-8 as the reference's
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(one_rank / "checkpoints" / "step4", resumed / "checkpoints" / "step4")
    for name in ("run_config.json", "ds_config.json"):
        shutil.copy(one_rank / name, resumed / name)
    proc = launch(REPO / "train.py", layout_flags(resumed, "zero2", *FEATURES), "python", cache_dir)
    check_ok(proc)
    assert f"resumed from {resumed / 'checkpoints' / 'step4'}" in proc.stdout + proc.stderr
    _assert_matches(resumed, layout_reference, steps=range(5, 9))
    sharded = tmp_path / "sp2_zero3"
    sp = ["--sequence_parallel_size", "2"]
    check_ok(
        launch(REPO / "train.py", layout_flags(sharded, "zero3", *FEATURES, *sp), "deepspeed", cache_dir, nprocs=2)
    )
    _assert_matches(sharded, layout_reference_zero3)

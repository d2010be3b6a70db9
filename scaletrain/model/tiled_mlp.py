"""--tiled_mlp: each decoder layer's MLP computed slice by slice along the sequence through DeepSpeed's `TiledMLP`
(ALST), since at long sequences the [tokens, intermediate] tensors (3-4x the hidden size, three of them) set the peak;
the backward recomputes each slice, and ZeRO reduces the gradients once, after the last (`ds_grad_is_ready`). Only
token-wise dense MLPs are tiled: a mixture-of-experts block routes across the batch, so it is refused by name. Default
slices, as ALST: ceil(tokens / hidden size), so a slice's intermediates are a few [hidden, hidden] matrices.
"""

from __future__ import annotations

import logging
import math
import types

from scaletrain.errors import UsageError

log = logging.getLogger(__name__)


def _decoder_mlps(model) -> list:
    """(name, module) of the MLP of every decoder layer: the `mlp` attribute of the model's repeated layers."""
    return [(f"{name}.mlp", module.mlp) for name, module in model.named_modules() if _is_layer(module)]


def _is_layer(module) -> bool:
    """A decoder layer: an attention module beside an `mlp` one."""
    import torch

    has_attention = any(hasattr(module, a) for a in ("self_attn", "attn", "attention"))
    return has_attention and isinstance(getattr(module, "mlp", None), torch.nn.Module)


def _tileable(mlp) -> bool:
    """A dense MLP: works token by token (no router, no experts)."""
    name = type(mlp).__name__
    return name.endswith("MLP") and not any(hasattr(mlp, a) for a in ("gate", "router", "experts"))


def check_tiled_mlp(model) -> int:
    """The number of MLPs --tiled_mlp tiles in `model` (a meta model will do); a model with none, or with an MLP
    that is not dense, is a UsageError naming the module type."""
    mlps = _decoder_mlps(model)
    if not mlps:
        raise UsageError(
            f"--tiled_mlp: {type(model).__name__} has no decoder-layer `mlp` module to tile",
            "drop --tiled_mlp for this model",
        )
    for name, mlp in mlps:
        if not _tileable(mlp):
            raise UsageError(
                f"--tiled_mlp: {name} is a {type(mlp).__name__}, which does not work token by token (a mixture of "
                "experts routes tokens across the batch), so it cannot be tiled",
                "drop --tiled_mlp for this model",
            )
    return len(mlps)


def tile_count(tokens: int, hidden: int, shards: int) -> int:
    """Slices for `tokens` tokens: `shards` when given, else ceil(tokens / hidden); never more than the tokens."""
    wanted = shards if shards > 0 else math.ceil(tokens / max(hidden, 1))
    return max(1, min(wanted, tokens))


def _tiled_forward(mlp, shards: int):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    dense_forward = type(mlp).forward

    def forward(self, hidden_states):
        import torch

        tiles = tile_count(hidden_states.shape[-2], hidden_states.shape[-1], shards)
        trainable = [p for p in self.parameters() if p.requires_grad]
        # TiledMLP's output needs gradients only through its input: an input without them (a frozen model below a
        # trainable MLP) would leave the MLP's own parameters without gradients, so that call runs untiled.
        if tiles == 1 or (torch.is_grad_enabled() and trainable and not hidden_states.requires_grad):
            return dense_forward(self, hidden_states)
        return TiledMLP.apply(dense_forward, self, hidden_states, tiles, trainable)

    return types.MethodType(forward, mlp)


def install_tiled_mlp(model, shards: int) -> None:
    """Replace the forward of every decoder layer's MLP in `model` by the tiled one (the module, its parameters
    and its state dict stay as they are)."""
    count = check_tiled_mlp(model)
    for _, mlp in _decoder_mlps(model):
        mlp.forward = _tiled_forward(mlp, shards)
    log.info(
        "tiled MLP: %d MLPs computed in %s",
        count,
        f"{shards} slices" if shards > 0 else "slices about the hidden size long (ALST's default)",
    )

"""DeepSpeed checkpoints of the engine and the train state, and the Hugging Face export of the weights."""

from __future__ import annotations

import logging
from pathlib import Path

from scaletrain.state import TrainState

log = logging.getLogger(__name__)
CHECKPOINT_DIR = "checkpoints"


def save_checkpoint(engine, output_dir: str, state: TrainState) -> Path:
    """Every rank writes its shard of model and optimizer states; the train state rides along as client state."""
    import time

    root = Path(output_dir) / CHECKPOINT_DIR
    tag = f"step{state.step}"
    started = time.perf_counter()
    engine.save_checkpoint(str(root), tag=tag, client_state={"train_state": state.state_dict()})
    log.info("saved checkpoint %s in %.1fs", root / tag, time.perf_counter() - started)
    return root / tag


def _full_state_dict_on_rank0(engine, is_main: bool) -> dict:
    """The trained weights as one CPU state dict on rank 0 (empty elsewhere).

    Under ZeRO-3 each rank holds a slice of every parameter; gathering them one at a time keeps the peak to one
    full parameter per rank, and the CPU copy on rank 0 is the only whole model anywhere. (Saving the module's
    own state_dict under ZeRO-3 is the known pitfall: it writes empty placeholders.)
    """
    import deepspeed

    module = engine.module
    if engine.zero_optimization_stage() != 3:
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()} if is_main else {}
    state = {}
    for name, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if is_main:
                state[name] = param.detach().cpu().clone()
    if is_main:
        for name, buf in module.named_buffers():
            # Non-persistent buffers (rotary tables) are rebuilt from the config; only persistent ones are saved.
            if name in module.state_dict():
                state[name] = buf.detach().cpu().clone()
    return state


def export_hf_model(engine, tokenizer, out_dir: str, is_main: bool) -> None:
    """Write safetensors weights, config and tokenizer that `AutoModelForCausalLM.from_pretrained` loads."""
    from scaletrain.distributed import barrier

    state = _full_state_dict_on_rank0(engine, is_main)
    if is_main:
        engine.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        log.info("exported Hugging Face model to %s", out_dir)
    barrier()

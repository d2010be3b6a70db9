"""lm-eval's HFLM over a live module on the run's process group (imports lm-eval: loaded only when an evaluation
is asked for). The why: scaletrain/harness/live_model.py."""

from __future__ import annotations

import logging

from lm_eval.models.huggingface import HFLM

from scaletrain.harness.lockstep import ForwardLockstep, causal_lm_of


class EngineLM(HFLM):
    """HFLM on the live module, distributed over the run's process group instead of accelerate's."""

    def __init__(self, module, *, tokenizer, batch_size: int, rank: int, world_size: int, lockstep: bool, progress):
        # A module, not a path: HFLM skips loading and accelerate (a rank and world size of its own). It also puts
        # the module in eval mode: put back (each evaluation switches it for its own time, scoring.py).
        was_training = module.training
        quiet = logging.getLogger("lm_eval.models.huggingface")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # "pretrained model kwarg is not of type str" is this class's design
        try:
            super().__init__(pretrained=module, tokenizer=tokenizer, batch_size=batch_size)
        finally:
            quiet.setLevel(level)
            module.train(was_training)
        self._rank, self._world_size = rank, world_size
        self.progress = progress
        self.lockstep = None
        if lockstep:
            self.lockstep = ForwardLockstep(causal_lm_of(module), self.device, self.prefix_token_id)

    # --- the distributed hooks lm-eval's evaluator calls (HFLM's go through accelerate)
    def all_gather(self, tensor):
        import torch
        import torch.distributed as dist

        if self.world_size <= 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def barrier(self):
        import torch.distributed as dist

        if self.world_size > 1:
            dist.barrier()

    # --- each request type, then the lockstep's join
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._joined("loglikelihood", super().loglikelihood, requests, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._joined("loglikelihood_rolling", super().loglikelihood_rolling, requests, disable_tqdm)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._joined("generate_until", super().generate_until, requests, disable_tqdm)

    def _joined(self, kind: str, method, requests, disable_tqdm: bool):
        self._note(f"{kind}, {len(requests)} requests")
        results = method(requests, disable_tqdm=disable_tqdm or self.rank != 0)
        if self.lockstep is not None:
            self.lockstep.join(self._note)
        return results

    def _model_call(self, inps, attn_mask=None, labels=None):
        self._note(f"forward of {tuple(inps.shape)}")
        return super()._model_call(inps, attn_mask=attn_mask, labels=labels)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        self._note(f"generation from {tuple(context.shape)}")
        if self.lockstep is not None:  # the lockstep pairs generate()'s forwards; its own per-token sync would not
            generation_kwargs["synced_gpus"] = False
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def _note(self, what: str) -> None:
        if self.progress is not None:
            self.progress(what)

    def close(self) -> None:
        if self.lockstep is not None:
            self.lockstep.close()

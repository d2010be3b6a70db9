"""ZeRO-3 with several ranks: every forward a collective, however many forwards each rank's requests need (the why:
scaletrain/harness/live_model.py)."""

from __future__ import annotations

from collections.abc import Callable


class ForwardLockstep:
    """Pairs every forward of a working rank with one forward on every other rank (ZeRO-3, several ranks)."""

    def __init__(self, model, device, idle_token: int):
        import torch

        self.model, self.device = model, device
        self._idle_ids = torch.tensor([[idle_token]], device=device)
        self._idle = False  # inside this rank's own stand-in forward: no vote
        self.forwards = 0  # real forwards this rank ran (tests, logs)
        self.stand_ins = 0  # forwards run only to keep the others' company
        # Before DeepSpeed's own pre-forward hooks (prepend): the vote precedes the layers' all-gathers on every rank.
        self._hook = model.register_forward_pre_hook(self._before_forward, prepend=True)

    def _vote(self, working: bool) -> int:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(working)], device=self.device, dtype=torch.int64)
        dist.all_reduce(flag)
        return int(flag.item())

    def _before_forward(self, module, args):
        if not self._idle:
            self._vote(True)
            self.forwards += 1

    def join(self, progress: Callable[[str], None] | None = None) -> None:
        """This rank's requests are done: run a stand-in forward for each forward another rank still runs."""
        import torch

        while self._vote(False):
            self._idle = True
            try:
                with torch.no_grad():
                    self.model(input_ids=self._idle_ids)
            finally:
                self._idle = False
            self.stand_ins += 1
            if progress is not None:
                progress("waiting for the other ranks' forwards")

    def close(self) -> None:
        self._hook.remove()


def causal_lm_of(module):
    """The module that runs each forward, generate()'s included: the base model under a LoRA (peft) wrapper."""
    get_base = getattr(module, "get_base_model", None)
    return get_base() if callable(get_base) else module

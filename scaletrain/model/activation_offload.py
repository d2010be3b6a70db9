"""--activation_offloading (TRL's spelling): the inputs of the checkpointed layers kept in host memory.

With --gradient_checkpointing a decoder layer keeps only its input (the hidden states, [batch, tokens, hidden]) for
the backward, which recomputes the rest; at long sequences those inputs, one per layer, are what is left of the
activations. Here each layer's checkpoint runs under autograd's saved-tensor hooks: torch's non-reentrant
checkpoint saves its inputs as saved tensors (and installs its own hooks inside the layer, so nothing else is
touched), the pack hook copies the input to host memory and lets the device copy go, the unpack hook brings it back
when the backward recomputes the layer.

On a GPU the host copy is pinned and made on a side stream (the device tensor is recorded on that stream so the
allocator does not reuse it before the copy ends); the copy back waits for it on the compute stream. On a CPU the
input is copied to another host tensor, so the same path runs and the losses are identical.
"""

from __future__ import annotations

import logging
from functools import partial

log = logging.getLogger(__name__)


class HostOffload:
    """Pack and unpack hooks that move saved tensors to host memory and back. One side stream per device."""

    def __init__(self) -> None:
        self._streams: dict = {}
        self.offloaded_bytes = 0  # the total moved to host (for a test or a log line)

    def _side_stream(self, device):
        import torch

        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pack(self, tensor):
        import torch

        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        if tensor.device.type != "cuda":
            return tensor.device, tensor.detach().clone(), None
        stream = self._side_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is computed
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        tensor.record_stream(stream)  # the allocator keeps the device memory until the copy ends
        return tensor.device, host, copied

    @staticmethod
    def unpack(packed):
        import torch

        device, host, copied = packed
        if copied is None:
            return host
        torch.cuda.current_stream(device).wait_event(copied)
        return host.to(device, non_blocking=True)


def offloaded_checkpoint(checkpoint, offload: HostOffload, function, *args, **kwargs):
    """`checkpoint(function, *args)` with the inputs it saves moved to host memory."""
    import torch

    with torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack):
        return checkpoint(function, *args, **kwargs)


def install_activation_offloading(model) -> HostOffload:
    """Route every checkpointed layer of `model` (gradient checkpointing already enabled) through the offload."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    offload = HostOffload()
    layers = 0
    for module in model.modules():
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)
        if checkpoint is not None and getattr(module, "gradient_checkpointing", False):
            module._gradient_checkpointing_func = partial(offloaded_checkpoint, checkpoint, offload)
            layers += isinstance(module, GradientCheckpointingLayer)
    if not layers:
        raise RuntimeError(f"--activation_offloading: {type(model).__name__} has no checkpointed layer")
    log.info("activation offloading: the inputs of %d checkpointed layers kept in host memory", layers)
    return offload

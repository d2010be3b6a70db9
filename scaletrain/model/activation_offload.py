"""--activation_offloading (TRL's spelling): the checkpointed layers' inputs, all that --gradient_checkpointing leaves
of the activations, kept in host memory. Each layer's checkpoint runs under saved-tensor hooks (non-reentrant
checkpointing installs its own inside the layer, so nothing else is touched): pack copies the input to the host, unpack
brings it back for the recompute. On a GPU the copy is pinned, on a side stream that the device tensor is recorded on so
the allocator cannot reuse it mid-copy; on a CPU the same path runs, so the losses are identical.
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

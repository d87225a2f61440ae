"""A compiled whole step (:mod:`.whole`) captured as one CUDA graph: a step becomes one launch.

A plan's shapes, kernels and memory never change between steps, which is what a CUDA graph
needs: the compiled step is run a few times on a side stream (the allocator and the
backend's lazy work settle), then captured once into a graph with inputs of its own.  Each
call copies the step's inputs into them (one fused copy), replays the graph, and hands back
copies of the outputs, so a value the caller keeps (a loss, the new params) is never
overwritten by the next replay.  The copies cost a read and a write of the inputs and
outputs, small beside a step on the GPU; the launches saved are the step's every kernel.

Only a step whose every input is on one CUDA device is captured; anything else, or a
capture CUDA refuses (a kernel that reads back to the host), keeps the compiled step as
it is, with a one-line notice from the caller.
"""
from __future__ import annotations

import torch

#: runs before the capture: the first allocates the step's buffers, the next reuse them
WARMUP = 2


def capturable(tensors: list) -> str | None:
    """Why a step over input ``tensors`` cannot be captured (None: it can)."""
    devices = {x.device for x in tensors}
    if not devices or any(d.type != "cuda" for d in devices):
        return "its inputs are not on a CUDA device"
    if len(devices) > 1:
        return "its inputs are on several devices"
    return None


class Graphed:
    """``fn(*tensors) -> list of tensors`` captured on ``example`` inputs' shapes and devices;
    called like ``fn``.  Raises what the warm-up runs or the capture raise."""

    def __init__(self, fn, example: list[torch.Tensor]):
        self.inputs = [x.detach().clone() for x in example]
        side = torch.cuda.Stream(device=self.inputs[0].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = list(fn(*self.inputs))

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        torch._foreach_copy_(self.inputs, list(tensors))
        self.graph.replay()
        return [y.clone() for y in self.outputs]

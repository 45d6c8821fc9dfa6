"""Device kernels one call launches, counted the same way on a GPU and on a CPU (where Triton's kernels run under
its interpreter): what the host must issue per call, the cost that grows when a Python loop runs over blocks.

    triton  launches of Triton kernels (every `kernel[grid](...)`, compiled or interpreted)
    torch   aten operators that launch a device kernel: all those dispatched that return a tensor, except the
            ones that only make a view of an input or an uninitialised allocation (NO_KERNEL), which launch
            nothing on a GPU (nor do those that return no tensor, such as promote_types)

Operators the interpreter itself runs to stage a kernel's arguments are not counted: a GPU runs none of them.
tests/test_pattention_flash_kernels.py counts flash's and fused's with it; benchmarks/gpu_pattention.py prints them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Allocations whose memory is left as it is: no kernel runs (torch.empty and its kin).
NO_KERNEL = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
             torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
             torch.ops.aten.new_empty_strided.default}


@dataclass
class Launches:
    triton: int = 0
    torch: int = 0

    @property
    def total(self) -> int:
        return self.triton + self.torch


def _launches_kernel(func) -> bool:
    """Whether aten operator `func` makes or writes a tensor's elements: it returns a tensor that is not an alias
    of an input left unwritten (view, t, split, ...), and it is not an uninitialised allocation."""
    if func in NO_KERNEL:
        return False
    tensors = [r for r in func._schema.returns if "Tensor" in str(r.type)]
    return any(r.alias_info is None or r.alias_info.is_write for r in tensors)


class _Counter(TorchDispatchMode):
    def __init__(self, launches: Launches) -> None:
        super().__init__()
        self.launches = launches
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and _launches_kernel(func):
            self.launches.torch += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _counting_triton(counter: _Counter):
    """Every Triton kernel launch in the block counted once, the operators its launch runs on the host not."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    classes = (jit.JITFunction, interpreter.InterpretedFunction)
    originals = {cls: cls.run for cls in classes}

    def counting(original):
        def run(self, *args, **kwargs):
            if kwargs.get("warmup"):
                return original(self, *args, **kwargs)
            counter.launches.triton += 1
            counter.paused = True
            try:
                return original(self, *args, **kwargs)
            finally:
                counter.paused = False
        return run

    for cls, original in originals.items():
        cls.run = counting(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


def device_launches(step: Callable[[], object]) -> Launches:
    """The kernels one call of `step()` launches (module docstring)."""
    launches = Launches()
    with _Counter(launches) as counter, _counting_triton(counter):
        step()
    return launches

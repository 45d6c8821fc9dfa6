"""Large new tensors backed by transparent huge pages, where the kernel offers them.

Growing a checkpoint writes its whole output (35 GiB for the 1-5B model grown ×2) into fresh memory. With
4 KiB pages the kernel faults and zeroes every page separately; in 2 MiB pages (Linux THP, enabled
"always" or "madvise") that costs a fraction: the 1-5B ×2 growth took 48 s instead of 60 s, its system
time 33 s instead of 52 s (benchmarks/RESULTS.md). Elsewhere, and for small tensors, this is torch.empty.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch
from torch import Tensor

_HUGE_PAGE = 2 << 20
_SMALLEST = 4 * _HUGE_PAGE  # below this, the huge pages would mostly lie outside the tensor


def empty(shape: Sequence[int], dtype: torch.dtype = torch.float32,
          device: torch.device | str = "cpu") -> Tensor:
    """An uninitialised contiguous tensor that owns its whole storage (torch.save writes just it)."""
    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or numel * dtype.itemsize < _SMALLEST or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    memory = mmap.mmap(-1, numel * dtype.itemsize + _HUGE_PAGE)  # anonymous; unmapped with the last tensor
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP: ordinary pages
        pass
    offset = -torch.frombuffer(memory, dtype=torch.uint8, count=1).data_ptr() % _HUGE_PAGE
    return torch.frombuffer(memory, dtype=dtype, count=numel, offset=offset).view(tuple(shape))


def copy_of(tensor: Tensor) -> Tensor:
    """A contiguous copy of `tensor` in its own storage (huge pages when large and on the CPU)."""
    return empty(tensor.shape, tensor.dtype, tensor.device).copy_(tensor)

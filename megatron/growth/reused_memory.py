"""Memory for the large tensors growth creates, reused once the tensors are gone.

Growing a checkpoint writes its whole output (35 GiB for the 1-5B model grown ×2) into new tensors. Fresh
memory from the allocator costs a page fault and a zeroing per 4 KiB page, about as much CPU as the copy
itself on our 2-core machine, and huge pages need compaction once the page cache fills RAM. The entries of
a model repeat a few shapes, so the mappings of tensors already written serve the next layer's: after the
first layers almost nothing is faulted again (the few new mappings ask for huge pages). Idle mappings
beyond IDLE_LIMIT bytes are let go.

Reuse happens inside `with pooled():` only (the growth tool's run), and the idle mappings go when it ends;
elsewhere (pretrain_partial_init in a training process) `empty` is torch.empty and nothing is kept.
"""

from __future__ import annotations

import math
import mmap
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

IDLE_LIMIT = 512 << 20
_PAGE = 2 << 20  # sizes round up to (and tensors start on) a huge page boundary
_SMALLEST = 4 * _PAGE  # smaller tensors come from torch's allocator
_PRIVATE = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)  # process memory (shared would be shmem)
_lock = threading.Lock()
_mappings: list[mmap.mmap] = []  # in use (a tensor's storage refers to it) or idle, oldest first
_pooling = 0  # how many pooled() blocks are open


def _references(index: int) -> int:
    return sys.getrefcount(_mappings[index])


_mappings.append(mmap.mmap(-1, mmap.PAGESIZE))
_UNUSED = _references(0)  # the count of a mapping no tensor refers to, however the interpreter counts
_mappings.clear()


def _mapping(size: int) -> mmap.mmap:
    """An idle mapping of `size` bytes, or a new one; lets go of the oldest idle ones beyond IDLE_LIMIT."""
    with _lock:
        idle = [index for index in range(len(_mappings)) if _references(index) == _UNUSED]
        reused = next((index for index in idle if len(_mappings[index]) == size), None)
        surplus = sum(len(_mappings[index]) for index in idle if index != reused) - IDLE_LIMIT
        dropped = set()
        for index in idle:
            if surplus <= 0:
                break
            if index != reused:
                dropped.add(index)
                surplus -= len(_mappings[index])
        memory = _mappings[reused] if reused is not None else mmap.mmap(-1, size, flags=_PRIVATE)
        if reused is None:
            if hasattr(mmap, "MADV_HUGEPAGE"):
                memory.madvise(mmap.MADV_HUGEPAGE)
            _mappings.append(memory)
        _mappings[:] = [mapping for index, mapping in enumerate(_mappings) if index not in dropped]
        return memory


@contextmanager
def pooled() -> Iterator[None]:
    """Reuse memory for large CPU tensors within the block; let go of the idle mappings when it ends (those
    of tensors still alive stay theirs)."""
    global _pooling
    with _lock:
        _pooling += 1
    try:
        yield
    finally:
        with _lock:
            _pooling -= 1
            if not _pooling:
                _mappings.clear()


def empty(shape: Sequence[int], dtype: torch.dtype = torch.float32,
          device: torch.device | str = "cpu") -> Tensor:
    """An uninitialised contiguous tensor that owns its whole storage (torch.save writes just it)."""
    numel = math.prod(shape)
    if not _pooling or torch.device(device).type != "cpu" or numel * dtype.itemsize < _SMALLEST:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    memory = _mapping(-(-numel * dtype.itemsize // _PAGE) * _PAGE + _PAGE)
    offset = -torch.frombuffer(memory, dtype=torch.uint8, count=1).data_ptr() % _PAGE
    return torch.frombuffer(memory, dtype=dtype, count=numel, offset=offset).view(tuple(shape))


def copy_of(tensor: Tensor) -> Tensor:
    """A contiguous copy of `tensor` in its own storage."""
    return empty(tensor.shape, tensor.dtype, tensor.device).copy_(tensor)

"""Activation memory of one forward + backward, for the Pattention tests, benchmarks and the memory model.

Three figures, all counted from the tensors themselves (independent of the device's allocator):
    saved_activation_bytes  what autograd keeps from forward until backward (tensors saved for backward,
                            except `exclude`d ones such as parameters and inputs): the memory that grows
                            with the number of layers;
    saved_storage_bytes     the same from a forward alone, counted by storage (benchmarks/memory_model.py
                            checks its formula against it for a whole model);
    peak_activation_bytes   the most bytes held at once by the storages that operators created during
                            forward + backward, transient buffers included, weight gradients not.
"""

import weakref
from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def saved_activation_bytes(forward: Callable[[], Tensor], exclude: Iterable[Tensor] = ()) -> int:
    """Bytes of the distinct tensors saved for backward while `forward()` runs (then its sum's backward)."""
    seen = {t.data_ptr() for t in exclude}
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward().sum().backward()
    return total


def saved_storage_bytes(forward: Callable[[], object], exclude: Iterable[Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward while `forward()` runs (no backward runs).

    Counted by storage, not by tensor: a saved view keeps its whole storage alive (attention's V is a view
    of the Q, K, V output), and views of one storage count once. The saved tensors are held until the end,
    so no freed storage's address can be reused by a later one and miscounted as the same. The graph keeps
    detached aliases: a node's own output saved as itself would reference the node back, a cycle through
    C++ that Python's collector cannot free when no backward releases it (a model's memory per call).
    """
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    held: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        alias = t.detach()
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            held.append(alias)
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(t.untyped_storage().nbytes() for t in held)


class _NewStorages(TorchDispatchMode):
    """Logs the storages operators create (not views, in-place or out= results of their inputs): one
    (allocation, +bytes) entry when created and (allocation, −bytes) when freed."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[int, int]] = []
        self.alive: dict[int, int] = {}  # allocation -> data_ptr, for those not freed yet

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        known = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for storage in {t.untyped_storage() for t in tree_leaves(out) if isinstance(t, Tensor)}:
            if storage.data_ptr() not in known and storage.nbytes():
                known.add(storage.data_ptr())
                allocation = len(self.log)
                self.log.append((allocation, storage.nbytes()))
                self.alive[allocation] = storage.data_ptr()
                weakref.finalize(storage, self._release, allocation, storage.nbytes())
        return out

    def _release(self, allocation: int, nbytes: int) -> None:
        self.log.append((allocation, -nbytes))
        del self.alive[allocation]


def peak_activation_bytes(step: Callable[[], None], leaves: Iterable[Tensor] = ()) -> int:
    """The most bytes held at once by tensors created inside `step()` (a forward + backward), not counting
    the gradients it leaves in `leaves`' .grad (weight gradients are not activations)."""
    with _NewStorages() as storages:
        step()
    grads = {t.grad.untyped_storage().data_ptr() for t in leaves if t.grad is not None}
    skipped = {allocation for allocation, ptr in storages.alive.items() if ptr in grads}
    held = peak = 0
    for allocation, nbytes in storages.log:
        if allocation not in skipped:
            held += nbytes
            peak = max(peak, held)
    return peak

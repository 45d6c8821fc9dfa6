"""The trained parameters' gradients in one flat buffer, averaged over the data-parallel ranks bucket by bucket
while backward still runs.

Each parameter's .grad is a view of the buffer, so autograd accumulates the micro-batches' gradients in place
(as torch DDP's `gradient_as_bucket_view` and Megatron-core's contiguous gradient buffers do) and the reduction
needs no copy. On the step's last micro-batch a post-accumulate-grad hook counts each bucket's finished
gradients; a finished bucket's all-reduce is started asynchronously and runs beside the rest of backward.
Buckets start in one order on every rank (the last first, as backward produces them): a bucket finished early
waits for the later ones to start.

The buckets, the collective and the division by the data-parallel size are DeepSpeed's, so that the averaged
gradients are its own bit for bit (its summation order over more than two ranks is the collective's, decided by
the reduced tensor's length and each element's place in it):

    ZeRO stage 1  DeepSpeed's `reduce_gradients` at the boundary: the gradients in the optimizer's order, a bucket
                  closed before the parameter that would take it past `reduce_bucket_size`, divided by the
                  data-parallel size, then all-reduced (`use_multi_rank_bucket_allreduce`, its default);
    stage 0       the engine's `buffered_allreduce_fallback`: the module's parameters in order, a bucket closed
                  after the parameter that takes it past 500,000,000 elements, all-reduced, then multiplied by
                  1 / the data-parallel size.

Every rank ends with the whole averaged gradient (an all-reduce, as DeepSpeed's ZeRO-1 runs it); the ZeRO update
then reads its own partition of it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors


def zero_one_buckets(sizes: list[int], bucket_size: int) -> list[int]:
    """Each bucket's end (an element offset) under DeepSpeed ZeRO's rule: a bucket is closed before the parameter
    that would take it past `bucket_size` (one larger than that is a bucket of its own)."""
    ends, filled, offset = [], 0, 0
    for size in sizes:
        if filled and filled + size > bucket_size:
            ends.append(offset)
            filled = 0
        filled, offset = filled + size, offset + size
    return ends + [offset]


def engine_buckets(sizes: list[int], bucket_size: int) -> list[int]:
    """Each bucket's end under DeepSpeed's engine rule (stage 0): closed after the parameter that takes it past
    `bucket_size`."""
    ends, filled, offset = [], 0, 0
    for size in sizes:
        filled, offset = filled + size, offset + size
        if filled > bucket_size:
            ends.append(offset)
            filled = 0
    return ends if ends and ends[-1] == offset else ends + [offset]


class GradientBuckets:
    """`params`' gradients as views of one flat buffer (`self.flat`, in `params`' order), reduced over `group` in
    the buckets ending at `bucket_ends`. `divide_first`: divide by the group's size before the all-reduce
    (ZeRO's placement), else multiply by its inverse after (the engine's)."""

    def __init__(self, params: list[torch.Tensor], bucket_ends: list[int], group: dist.ProcessGroup,
                 divide_first: bool) -> None:
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        for p, view in zip(params, _unflatten_dense_tensors(self.flat, params), strict=True):
            p.grad = view
        self.group, self.size, self.divide_first = group, dist.get_world_size(group), divide_first
        self.bounds = list(zip([0, *bucket_ends[:-1]], bucket_ends, strict=True))
        self.works: list[dist.Work | None] = [None] * len(self.bounds)
        self.last_micro_batch = False
        self.hooks = []
        if self.size == 1:
            return
        self.pending = [0] * len(self.bounds)
        self.bucket_of = []
        offset = 0
        for p in params:
            bucket = next(k for k, (_, end) in enumerate(self.bounds) if offset < end)
            self.bucket_of.append(bucket)
            offset += p.numel()
            self.hooks.append(p.register_post_accumulate_grad_hook(self._finished(bucket)))
        self.expected = [self.bucket_of.count(k) for k in range(len(self.bounds))]
        self.next_to_start = len(self.bounds) - 1

    def _finished(self, bucket: int):
        def hook(_: torch.Tensor) -> None:
            if self.last_micro_batch:
                self.pending[bucket] += 1
                while self.next_to_start >= 0 and self.pending[self.next_to_start] == self.expected[self.next_to_start]:
                    self._start(self.next_to_start)
        return hook

    def _start(self, bucket: int) -> None:
        start, end = self.bounds[bucket]
        view = self.flat[start:end]
        if self.divide_first:
            view.div_(self.size)
        self.works[bucket] = dist.all_reduce(view, group=self.group, async_op=True)
        self.next_to_start = bucket - 1

    def start_step(self, last_micro_batch: bool) -> None:
        """Before each micro-batch's backward: whether it is the step's last (whose gradients are reduced)."""
        self.last_micro_batch = last_micro_batch

    def wait(self) -> None:
        """The averaged gradients in `flat`: the buckets no hook started (parameters without a gradient) started
        in order, every all-reduce waited for."""
        if self.size == 1:
            return
        while self.next_to_start >= 0:
            self._start(self.next_to_start)
        for (start, end), work in zip(self.bounds, self.works, strict=True):
            work.wait()
            if not self.divide_first:
                self.flat[start:end].mul_(1.0 / self.size)
        self.works = [None] * len(self.bounds)
        self.pending = [0] * len(self.bounds)
        self.next_to_start = len(self.bounds) - 1
        self.last_micro_batch = False

    def zero(self) -> None:
        """After the update: the next step accumulates from zero."""
        self.flat.zero_()

"""Deterministic, resumable batch sampler for pretraining (Megatron's MegatronPretrainingSampler semantics)."""

from collections.abc import Iterator


class PretrainingSampler:
    """Yields this data-parallel rank's micro-batch of sample indices, global batch after global batch.

    A global batch is ``micro_batch_size * data_parallel_size`` consecutive
    indices starting at ``consumed_samples``; rank r takes the r-th slice of
    ``micro_batch_size``. The order depends on nothing but ``consumed_samples``,
    so a run restarted with ``consumed_samples = iteration * global batch``
    reads exactly the samples an uninterrupted run would have read next (the
    dataset itself is already shuffled). Use as ``DataLoader(batch_sampler=...)``.

    With ``drop_last=False`` a final partial global batch is split in rank
    order, so ranks past its end get a short or no last micro-batch.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(f"total_samples must be positive, got {total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} must lie in [0, total_samples={total_samples}): "
                f"the dataset is exhausted; build it with more samples (train_iters) to continue"
            )
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(
                f"micro_batch_size and data_parallel_size must be positive, "
                f"got {micro_batch_size}, {data_parallel_size}"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} must lie in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_batch_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def _micro_batch_starts(self) -> range:
        """First index of each of this rank's micro-batches."""
        full, partial = divmod(self.total_samples - self.consumed_samples, self.global_batch_size)
        rank_offset = self.data_parallel_rank * self.micro_batch_size
        count = full + (1 if not self.drop_last and rank_offset < partial else 0)
        first = self.consumed_samples + rank_offset
        return range(first, first + count * self.global_batch_size, self.global_batch_size)

    def __len__(self) -> int:
        return len(self._micro_batch_starts())

    def __iter__(self) -> Iterator[list[int]]:
        for start in self._micro_batch_starts():
            yield list(range(start, min(start + self.micro_batch_size, self.total_samples)))

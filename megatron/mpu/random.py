"""Random streams for dropout under tensor parallelism.

Replicated activations (the residual stream, embeddings) must get the *same* dropout mask on every
tensor-parallel rank, or the replicas drift apart: they draw from the default generators, seeded alike on
every rank. Split activations (each rank's attention heads) must get *different* masks, or every rank
would drop the same positions of different heads: they draw, inside `split_region_rng()`, from a
generator the tracker keeps per rank, seeded `seed + 2718 + tensor rank` (Megatron's offset).

Activation checkpointing recomputes a forward pass during backward: torch restores the default
generators itself, and `checkpoint_context_fn` makes the recomputation replay the tracker's generator
from where the original forward pass started.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch.utils.checkpoint
from torch import Tensor

from megatron.mpu.initialize import get_tensor_parallel_rank, get_tensor_parallel_world_size

MODEL_PARALLEL_SEED_OFFSET = 2718
_SPLIT_REGION = "model-parallel"


def _accelerator():
    """DeepSpeed's accelerator (whose generator dropout uses), imported on first use so that building a
    model does not import DeepSpeed."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


class RNGStatesTracker:
    """Named generator states of the accelerator, swapped in by `fork(name)` and advanced there."""

    def __init__(self) -> None:
        self._states: dict[str, Tensor] = {}

    def get_states(self) -> dict[str, Tensor]:
        return dict(self._states)

    def set_states(self, states: dict[str, Tensor]) -> None:
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """A new stream `name` starting from `seed`; the current generator state is left as it was."""
        accelerator = _accelerator()
        current = accelerator.get_rng_state()
        accelerator.manual_seed(seed)
        self._states[name] = accelerator.get_rng_state()
        accelerator.set_rng_state(current)

    @contextmanager
    def fork(self, name: str = _SPLIT_REGION) -> Iterator[None]:
        """Draw from stream `name` inside the block, then return to the generator state before it."""
        if name not in self._states:
            raise RuntimeError(f"random stream {name!r} is not seeded: call mpu.seed_model_parallel_rng(seed) "
                               "after initialize_model_parallel")
        accelerator = _accelerator()
        current = accelerator.get_rng_state()
        accelerator.set_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = accelerator.get_rng_state()
            accelerator.set_rng_state(current)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def seed_model_parallel_rng(seed: int) -> None:
    """Seed the split-region stream of this rank; call after `initialize_model_parallel` on every rank."""
    _TRACKER.set_states({})
    _TRACKER.add(_SPLIT_REGION, seed + MODEL_PARALLEL_SEED_OFFSET + get_tensor_parallel_rank())


def split_region_rng() -> AbstractContextManager[None]:
    """Context for random ops on tensor-parallel-split activations; with one rank nothing is split and
    the default generator serves."""
    return nullcontext() if get_tensor_parallel_world_size() == 1 else _TRACKER.fork()


@contextmanager
def _replaying(states: dict[str, Tensor]) -> Iterator[None]:
    current = _TRACKER.get_states()
    _TRACKER.set_states(states)
    try:
        yield
    finally:
        _TRACKER.set_states(current)


def checkpoint_context_fn() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """`context_fn` for torch.utils.checkpoint: (forward context, recomputation context). The
    recomputation sees the tracker's streams as they were when the forward pass started, and leaves them
    as it found them."""
    return nullcontext(), _replaying(_TRACKER.get_states())


def checkpoint(function: Callable[..., Tensor], *args: Any) -> Tensor:
    """`function(*args)`, its activations recomputed in the backward pass instead of kept (torch's
    non-reentrant checkpointing), with the tracker's streams replayed for the recomputation."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=checkpoint_context_fn)

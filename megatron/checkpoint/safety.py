"""Open checkpoint files without running code from them (whether one fits the model: compatibility.py).

A `.pt` file is a pickle, and unpickling can call any function the file names.
Our own reads use `torch.load(weights_only=True)`, which only rebuilds tensors
and plain containers. DeepSpeed's `engine.load_checkpoint` unpickles fully
(its ZeRO shards hold a few DeepSpeed objects), so before it runs every file is
screened: the pickle's referenced globals are listed without executing it, and
any outside torch's weights-only allowlist and the DeepSpeed classes below make
the checkpoint refused (docs/reliability.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class CheckpointRefused(RuntimeError):
    """A checkpoint that cannot be resumed from: incomplete, corrupted, unsafe or of another model."""


# What DeepSpeed 0.19's checkpoints contain beyond tensors and containers: ZeRO's parameter slice map,
# its stage, and the (fp16) loss scalers kept with the optimizer state.
DEEPSPEED_CHECKPOINT_CLASSES = frozenset({
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
})


def unpickling_problems(directory: Path, name: str) -> list[str]:
    """Why `name` must not be unpickled ([] if it is safe, or not a torch file at all)."""
    if not name.endswith(".pt"):
        return []
    try:
        unexpected = set(torch.serialization.get_unsafe_globals_in_checkpoint(directory / name))
    except (RuntimeError, ValueError, OSError) as error:
        reason = (str(error) or type(error).__name__).splitlines()[0]
        return [f"{name} is not a readable torch file (truncated or corrupted): {reason}"]
    unexpected -= DEEPSPEED_CHECKPOINT_CLASSES
    if unexpected:
        return [f"{name} refers to {', '.join(sorted(unexpected))}, which loading would run; a checkpoint holds "
                "only tensors and DeepSpeed's checkpoint classes (megatron/checkpoint/safety.py)"]
    return []


def load_weights_only(path: Path) -> Any:
    """`torch.load` that cannot run code from the file; memory-mapped, so reading shapes costs no copy."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)

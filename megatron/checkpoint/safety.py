"""Open checkpoint files without running code from them (whether one fits the model: compatibility.py).

A `.pt` file is a pickle, and unpickling can call any function the file names.
Our own reads use `torch.load(weights_only=True)`, which only rebuilds tensors
and plain containers. DeepSpeed's `engine.load_checkpoint` unpickles fully
(its ZeRO shards hold a few DeepSpeed objects), so before it runs every file is
screened: the pickle's referenced globals are listed without executing it, and
any outside torch's weights-only allowlist and the DeepSpeed classes below make
the checkpoint refused (docs/reliability.md); a getattr is allowed only where a
weights-only load shows each of its uses to be an enum lookup.
"""

from __future__ import annotations

import enum
import importlib
import pickle
import threading
import zipfile
from functools import cache
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
# Some Python 3.11 builds pickle a member of an int-mixin enum, such as ZeRO's stage, by name: as
# getattr(ZeroStageEnum, "optimizer_states") (Debian 12's 3.11.2 does, 3.11.7 does not). A load stands
# `enum_member` in for getattr, so that a file can look up such members and nothing else.
ENUM_LOOKUP = "builtins.getattr"


@cache
def deepspeed_classes() -> tuple[type, ...]:
    """The DeepSpeed classes ZeRO shards pickle, which a weights-only load may rebuild (but not run)."""
    modules = (name.rpartition(".") for name in sorted(DEEPSPEED_CHECKPOINT_CLASSES))
    return tuple(getattr(importlib.import_module(module), name) for module, _, name in modules)


def enum_member(cls: Any, name: Any) -> enum.Enum:
    """getattr, as far as a checkpoint may use it: a member of one of DeepSpeed's checkpoint enums."""
    if not (cls in deepspeed_classes() and issubclass(cls, enum.Enum) and name in cls.__members__):
        raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not a member of a DeepSpeed checkpoint enum")
    return cls[name]


# torch's safe_globals is process-wide: a thread leaving it takes the allowance from another still loading.
_ALLOWANCE = threading.Lock()


def load_checkpoint_file(path: Path) -> Any:
    """A DeepSpeed checkpoint file, memory-mapped, unpickling only tensors, containers and DeepSpeed's classes
    (one thread at a time: files are screened and verified on several)."""
    with _ALLOWANCE, torch.serialization.safe_globals([*deepspeed_classes(), (enum_member, ENUM_LOOKUP)]):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _is_legacy_torch_file(path: Path) -> bool:
    """torch.save's format before torch 1.6 (or with _use_new_zipfile_serialization=False): bare pickles, no zip."""
    with open(path, "rb") as stream:
        return stream.read(2) == b"\x80\x02" and not zipfile.is_zipfile(path)


def torch_file_problems(path: Path) -> list[str]:
    """Why the torch file `path` must not be unpickled, naming it ([] if it is safe)."""
    name = path.name
    try:
        unexpected = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except (RuntimeError, ValueError, OSError, pickle.UnpicklingError) as error:
        if path.is_file() and _is_legacy_torch_file(path):
            return [f"{name} is in torch's legacy format (saved before torch 1.6), whose pickle cannot be screened "
                    "without running it: if you trust it, load it with torch.load(weights_only=False) and torch.save "
                    "it again (megatron/checkpoint/safety.py)"]
        reason = (str(error) or type(error).__name__).splitlines()[0]
        return [f"{name} is not a readable torch file (truncated or corrupted): {reason}"]
    unexpected -= DEEPSPEED_CHECKPOINT_CLASSES
    if unexpected == {ENUM_LOOKUP}:
        # The same bytes unpickle the same calls: if each getattr is an enum lookup here, it is one in DeepSpeed's load.
        try:
            load_checkpoint_file(path)
            unexpected = set()
        except (pickle.UnpicklingError, RuntimeError, ValueError, OSError):
            pass
    if unexpected:
        return [f"{name} refers to {', '.join(sorted(unexpected))}, which loading would run; a checkpoint holds "
                "only tensors and DeepSpeed's checkpoint classes (megatron/checkpoint/safety.py)"]
    return []


def unpickling_problems(directory: Path, name: str) -> list[str]:
    """Why checkpoint file `name` must not be unpickled ([] if it is safe, or not a torch file at all)."""
    return torch_file_problems(directory / name) if name.endswith(".pt") else []


def load_weights_only(path: Path) -> Any:
    """`torch.load` that cannot run code from the file; memory-mapped, so reading shapes costs no copy."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)

"""What the stand-alone Pattention checks where user code meets it: its sizes, and each input against them.

Without these, a size or score scale of 0 builds a layer that learns nothing (a size of 0 divides by zero in
fused's backward), and a float size, a wrong width or dtype, or a NumPy array ends in a torch error many frames
deep. The input checks
run on every call: attribute reads only, no device synchronisation.
"""

import math
from numbers import Integral, Real

import torch
from torch import Tensor


def checked_int(where: str, value: object, meaning: str, positive: bool = True) -> int:
    """`value` as an int; TypeError (a bool, a float, ...) or ValueError (not positive) naming `where`."""
    wanted = "a positive int" if positive else "an int"
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{where}: must be {wanted} ({meaning}), not a {type(value).__name__}")
    if positive and value <= 0:
        raise ValueError(f"{where}: must be {wanted} ({meaning})")
    return int(value)


def checked_positive_finite(where: str, value: object, meaning: str) -> float:
    """`value` as a float; TypeError (a bool, a string, ...) or ValueError (NaN, ±inf, 0 or below) naming `where`:
    a NaN scale would make every output NaN, a zero one every score 0 (a layer that never learns), and a
    negative one flips them (the config refuses both)."""
    wanted = "a positive finite number"
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{where}: must be {wanted} ({meaning}), not a {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}: must be {wanted} ({meaning})")
    return float(value)


def checked_dtype(where: str, value: object) -> torch.dtype | None:
    """`value` if it is a floating-point torch.dtype (or None: torch's default); TypeError naming `where`."""
    if value is None or (isinstance(value, torch.dtype) and value.is_floating_point):
        return value
    raise TypeError(f"{where}: must be a floating-point torch.dtype for the parameter tokens, e.g. torch.bfloat16")


def _type_name(value: object) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def checked_input(x: object, d_in: int, dtype: torch.dtype) -> torch.dtype | None:
    """Check that `x` is input [..., d_in] for parameter tokens of `dtype`; returns the dtype torch.autocast
    computes it in (as it would an nn.Linear's), None where autocast is off for its device."""
    if not isinstance(x, Tensor):
        fix = "torch.from_numpy(x) (and .float())" if type(x).__module__ == "numpy" else "torch.as_tensor(x)"
        raise TypeError(f"Pattention input: a {_type_name(x)}, not a torch.Tensor; convert it with {fix}")
    if x.dim() == 0:
        raise ValueError(f"Pattention input: a 0-dim tensor; the input must be [..., {d_in}]")
    if x.shape[-1] != d_in:
        raise ValueError(f"Pattention input: the last dimension is {x.shape[-1]} (shape {list(x.shape)}) but d_in is "
                         f"{d_in}; the input must be [..., {d_in}]")
    device = x.device.type
    if x.is_floating_point() and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    if x.dtype != dtype:
        fix = (f"x.to({dtype}), the layer with layer.to({x.dtype}), or run it under torch.autocast"
               if x.is_floating_point() else f"x.to({dtype})")
        raise TypeError(f"Pattention input: {x.dtype}, but the layer computes in {dtype}; cast it with {fix}")
    return None

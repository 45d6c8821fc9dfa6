"""Every random generator of a rank, as tensors, ints and floats only.

A checkpoint's `rng_state_RANK.pt` holds this dictionary, so it loads with
`torch.load(weights_only=True)`: NumPy's state would otherwise be pickled as an
ndarray, which only full (code-running) unpickling can read back.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from megatron import mpu


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch, accelerator and tensor-parallel generator states."""
    python_version, python_state, python_gauss = random.getstate()
    numpy_kind, numpy_keys, numpy_position, numpy_has_gauss, numpy_gauss = np.random.get_state()
    return {
        "python": {"version": python_version, "state": torch.tensor(python_state, dtype=torch.int64),
                   "gauss": python_gauss},
        "numpy": {"kind": numpy_kind, "keys": torch.from_numpy(numpy_keys.astype(np.int64)),
                  "position": int(numpy_position), "has_gauss": int(numpy_has_gauss), "gauss": float(numpy_gauss)},
        "torch": torch.get_rng_state(),
        "accelerator": get_accelerator().get_rng_state(),
        "tensor_parallel": mpu.get_rng_tracker().get_states(),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["gauss"]))
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["accelerator"])
    mpu.get_rng_tracker().set_states(state["tensor_parallel"])

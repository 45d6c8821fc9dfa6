"""DeepSpeed's ZeRO optimizer check, answered without importing DeepSpeed's Muon optimizer.

While building a ZeRO engine, DeepSpeed 0.19 asks `is_zero_supported_optimizer` whether ZeRO was tested with the
run's optimizer. That function first imports its Muon optimizer, to add it to the list, and Muon's
`torch.compile` decorators import inductor: 0.9 CPU-seconds and 44 MB in every rank (benchmarks/RESULTS.md).
Our optimizer is torch's AdamW, on DeepSpeed's list without Muon, so the answer for it needs no import; any other
optimizer gets DeepSpeed's own check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import deepspeed.runtime.engine as engine_module
from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS


@contextlib.contextmanager
def zero_check_without_muon() -> Iterator[None]:
    """Within the block, DeepSpeed's engine answers its ZeRO check for a listed optimizer type from its list."""
    deepspeeds_check = engine_module.is_zero_supported_optimizer

    def is_zero_supported_optimizer(optimizer) -> bool:
        return type(optimizer) in ZERO_SUPPORTED_OPTIMIZERS or deepspeeds_check(optimizer)

    engine_module.is_zero_supported_optimizer = is_zero_supported_optimizer
    try:
        yield
    finally:
        engine_module.is_zero_supported_optimizer = deepspeeds_check

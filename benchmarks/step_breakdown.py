"""Where a training step's time goes, from a torch.profiler trace of a few steps.

Every event of the trace is given the phase whose marker (megatron/training/phases.py) was open on the main
thread when it started: backward's operators, which the autograd engine may run on a thread of its own (CUDA),
fall in the backward marker's time span like the main thread's. Within backward, the model's gradients are what
autograd's nodes compute; the rest is the engine's gradient work, counted as gradient copies and reductions:
what runs under AccumulateGrad (DeepSpeed's hooks copying each gradient into its buckets) and what runs outside
any autograd node (DeepSpeed's epilogue reducing the buckets). Per phase and per step:

    host ms      CPU time of the operators and of the Python around them (markers' own time included)
    device ms    time of the kernels the phase's operators launched (0 on a CPU)
    ops          top-level operators dispatched (each a kernel launch or more on a GPU)
    syncs        host waits for the device: .item() / float(tensor) (aten::_local_scalar_dense) and the CUDA
                 runtime's synchronize calls
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field

from megatron.training.phases import BACKWARD, GRADIENT_REDUCTION, PHASES

OUTSIDE = "outside the phases"
SYNC_NAMES = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
              "cudaEventSynchronize")


@dataclass
class PhaseCost:
    host_ms: float = 0.0
    device_ms: float = 0.0
    ops: float = 0.0
    syncs: float = 0.0
    # top-level operator name -> [calls, host ms, device ms] (its own and its callees')
    operators: dict[str, list[float]] = field(default_factory=dict)

    def top(self, count: int, on_device: bool) -> list[tuple[str, list[float]]]:
        """The `count` operators that cost most (device time on a GPU, host time elsewhere)."""
        return sorted(self.operators.items(), key=lambda item: -item[1][2 if on_device else 1])[:count]


class _Markers:
    """The main thread's phase markers, to find the innermost one open at a moment."""

    def __init__(self, events) -> None:
        marks = sorted((e for e in events if e.name in PHASES), key=lambda e: e.time_range.start)
        self.starts = [m.time_range.start for m in marks]
        self.marks = marks

    def phase_at(self, moment: float) -> str:
        index = bisect.bisect_right(self.starts, moment)
        # Markers nest or follow each other: the latest one started at or before `moment` that is still open
        # is the innermost.
        for mark in reversed(self.marks[max(0, index - 16):index]):
            if mark.time_range.end >= moment:
                return mark.name
        return OUTSIDE


def _within(event, fragment: str) -> bool:
    """Whether `event` or one of the events it runs inside is named with `fragment`."""
    while event is not None:
        if fragment in event.name:
            return True
        event = event.cpu_parent
    return False


def _is_top_level_op(event) -> bool:
    parent = event.cpu_parent
    return event.name.startswith(("aten::", "c10d::")) and not (
        parent is not None and parent.name.startswith(("aten::", "c10d::")))


def breakdown(events, steps: int) -> dict[str, PhaseCost]:
    """Cost per phase and per step of the profiler's `events` (prof.events()) covering `steps` steps."""
    markers = _Markers(events)
    costs = {name: PhaseCost() for name in (*PHASES, OUTSIDE)}
    for event in events:
        if event.device_type.name != "CPU":
            continue  # a kernel's time is counted with the operator that launched it
        name = event.name if event.name in PHASES else markers.phase_at(event.time_range.start)
        if name == BACKWARD and event.name != BACKWARD and (
                _within(event, "AccumulateGrad") or not _within(event, "autograd::engine::evaluate_function")):
            name = GRADIENT_REDUCTION
        cost = costs[name]
        cost.host_ms += event.self_cpu_time_total / 1e3
        cost.device_ms += event.self_device_time_total / 1e3
        cost.syncs += event.name in SYNC_NAMES
        if _is_top_level_op(event):
            cost.ops += 1
            calls = cost.operators.setdefault(event.name, [0, 0.0, 0.0])
            calls[0] += 1
            calls[1] += event.cpu_time_total / 1e3
            calls[2] += event.device_time_total / 1e3
    for cost in costs.values():
        for name in ("host_ms", "device_ms", "ops", "syncs"):
            setattr(cost, name, getattr(cost, name) / steps)
        cost.operators = {op: [value / steps for value in values] for op, values in cost.operators.items()}
    return {name: cost for name, cost in costs.items() if cost.host_ms or cost.device_ms or cost.ops}


def as_json(costs: dict[str, PhaseCost]) -> dict[str, dict]:
    return {name: asdict(cost) for name, cost in costs.items()}

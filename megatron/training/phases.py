"""The phases of a training step, marked for torch.profiler.

Each phase is a `record_function` range, so a profile of a run (or benchmarks/framework_step.py's breakdown)
splits a step's time into what the framework does: reading data, forward, the loss, backward, the optimizer
step, reading the loss back, and the loop's own bookkeeping. A marker costs a few microseconds per step whether
or not a profiler runs. DeepSpeed's pipeline engine runs a step as a schedule of instructions; `mark_pipeline`
gives each instruction the phase it belongs to.
"""

from __future__ import annotations

from torch.profiler import record_function

DATA = "phase: data"
FORWARD = "phase: forward"
LOSS = "phase: loss"
BACKWARD = "phase: backward"
GRADIENT_REDUCTION = "phase: gradient copies and reductions"
OPTIMIZER = "phase: optimizer"
LOSS_READOUT = "phase: loss readout"
BOOKKEEPING = "phase: bookkeeping"  # learning rate, non-finite check, exit conditions
LOGGING = "phase: logging"

PHASES = (DATA, FORWARD, LOSS, BACKWARD, GRADIENT_REDUCTION, OPTIMIZER, LOSS_READOUT, BOOKKEEPING, LOGGING)

# DeepSpeed's pipeline instructions (deepspeed.runtime.pipe.schedule) by phase; the send/receive instructions of
# a multi-stage pipeline are the stages' communication, counted with forward and backward.
_PIPELINE_PHASES = {
    "LoadMicroBatch": DATA, "ForwardPass": FORWARD, "SendActivation": FORWARD, "RecvActivation": FORWARD,
    "BackwardPass": BACKWARD, "SendGrad": BACKWARD, "RecvGrad": BACKWARD,
    "ReduceGrads": GRADIENT_REDUCTION, "ReduceTiedGrads": GRADIENT_REDUCTION, "OptimizerStep": OPTIMIZER,
}


def phase(name: str) -> record_function:
    """`with phase(FORWARD): ...` marks the block for the profiler."""
    return record_function(name)


def mark_pipeline(engine) -> None:
    """Run each instruction of DeepSpeed's pipeline `engine` inside its phase's marker (an instance-level copy
    of the engine's instruction table; the instructions themselves are DeepSpeed's, unchanged)."""

    def marked(name: str, execute):
        def run(self, **kwargs):
            with phase(name):
                return execute(self, **kwargs)
        return run

    engine._INSTRUCTION_MAP = {instruction: marked(_PIPELINE_PHASES.get(instruction.__name__, FORWARD), execute)
                               for instruction, execute in type(engine)._INSTRUCTION_MAP.items()}

"""A training step as the Trainer runs it (one gloo rank, tests/tiny.yml, ZeRO-1): the lean step with the plain model
and with the pipeline model, and DeepSpeed's pipeline engine: every phase of megatron/training/phases.py is marked
once per step for the profiler (the pipeline's instructions included), benchmarks/step_breakdown.py gives each
phase its operators, and no phase asks the accelerator to synchronize (DeepSpeed's throughput timer would, twice a
step); the lean step reads nothing back to the host but its loss and norm, in one transfer."""

from __future__ import annotations

import pytest
from deepspeed.accelerator import get_accelerator
from torch.profiler import ProfilerActivity, profile

from benchmarks.step_breakdown import OUTSIDE, breakdown
from megatron.config import load_config
from megatron.training import phases
from megatron.training.pretrain import Trainer
from tests.conftest import REPO
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.slow

STEPS = 2


def profiled_steps(overrides: list[str]) -> dict:
    trainer = Trainer(load_config([REPO / "tests" / "tiny.yml"], overrides, world_size=1))
    trainer.train(until=1)  # warm-up
    accelerator = get_accelerator()
    synchronize, calls = accelerator.synchronize, []
    accelerator.synchronize = lambda *args, **kwargs: calls.append(args) or synchronize(*args, **kwargs)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train(until=1 + STEPS)
    finally:
        accelerator.synchronize = synchronize
    trainer.metrics.close()
    marks = {name: sum(e.name == name for e in prof.events()) for name in phases.PHASES}
    costs = breakdown(prof.events(), STEPS)
    return {"marks": marks, "synchronize_calls": len(calls), "iteration": trainer.state.iteration,
            "ops": {name: cost.ops for name, cost in costs.items()},
            "readout_syncs": costs[phases.LOSS_READOUT].syncs,
            # torch's fused AdamW on a CPU reads each step count with .item() (on a GPU it does not); a new data
            # iterator draws its seed with one, outside the phases, once per call of train()
            "syncs_in_the_loop": sum(cost.syncs for name, cost in costs.items()
                                     if name not in (phases.OPTIMIZER, OUTSIDE)),
            "step": type(trainer.train_step).__name__}


@pytest.mark.parametrize(("pipe_parallel_size", "lean_step"), [(0, True), (1, True), (1, False)])
def test_every_phase_is_marked_each_step_and_nothing_synchronizes_the_device(demo_data, tmp_path,
                                                                             pipe_parallel_size, lean_step):
    overrides = [f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json",
                 "num_gpus=1", "gradient_accumulation_steps=1", "train_micro_batch_size_per_gpu=2",
                 "train_iters=3", "lr_decay_iters=3", "eval_interval=100", f"log_dir={tmp_path}",
                 f"pipe_parallel_size={pipe_parallel_size}", f"lean_step={str(lean_step).lower()}"]
    [result] = run_on_ranks(1, profiled_steps, overrides)
    assert result["iteration"] == 1 + STEPS
    assert result["step"] == ("LeanStep" if lean_step else "partial")
    marks = result["marks"]
    for name in (phases.DATA, phases.FORWARD, phases.LOSS, phases.BACKWARD, phases.OPTIMIZER):
        assert marks[name] == STEPS, (name, marks)
    assert marks[phases.LOSS_READOUT] == (STEPS if lean_step else 2 * STEPS)  # DeepSpeed's: the loss, then the norm
    assert marks[phases.LOGGING] == STEPS  # tiny.yml logs every step
    assert result["synchronize_calls"] == 0
    ops = result["ops"]
    assert ops[phases.FORWARD] > 0 and ops[phases.BACKWARD] > 0 and ops[phases.OPTIMIZER] > 0
    assert ops.get(OUTSIDE, 0) < ops[phases.FORWARD] / 10  # the phases cover the step
    if lean_step:
        assert marks[phases.GRADIENT_REDUCTION] == 0  # no buckets, no reductions
        assert result["syncs_in_the_loop"] == 0  # its loss and norm: one .tolist(), no .item()
    else:
        assert marks[phases.GRADIENT_REDUCTION] == 2 * STEPS  # the pipeline's ReduceTiedGrads and ReduceGrads
        assert result["readout_syncs"] >= 1  # DeepSpeed's path reads the loss back with .item()

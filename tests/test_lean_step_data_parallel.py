"""The lean step (megatron/training/lean_step.py) on more than one data-parallel rank, against DeepSpeed's own step,
on tests/tiny.yml with real gloo processes (its gradients averaged by megatron/training/gradient_buckets.py):

- where the clipping factor is 1, the losses and the checkpoint files (flat masters, Adam moments and counters,
  partitioned as ZeRO-1 partitions them) are DeepSpeed's bit for bit at DP 2 and 4, with ZeRO-1 and stage 0, in
  bf16, and at TP 2 x DP 2; dropout is on, and a checkpoint either step wrote at DP 2 resumes on the other to
  the uninterrupted losses;
- in fp16 (on CPU tensors: the Trainer refuses fp16 on a CPU, where it is slow, and so does DeepSpeed on some;
  the fp16 run here lifts those two checks), with DeepSpeed's dynamic loss scale starting high enough to skip
  steps, the same, skipped steps too;
- where clipping scales, the norm and the losses are DeepSpeed's within fp32 rounding.
"""

from __future__ import annotations

import math
import shutil

import pytest

from tests.test_lean_step import DEEPSPEED, ITERATIONS, NO_CLIPPING, assert_same_checkpoint_files, losses, \
    relative_errors, run, train

pytestmark = pytest.mark.slow

DROPOUT = ("hidden_dropout=0.1", "attention_dropout=0.1")
FP16 = "fp16={enabled: true, initial_scale_power: 19}"  # steps overflow until the scale has come down
FP16_ROUNDING = 2.0**-11  # fp16's unit roundoff


def train_fp16_on_cpu(overrides: list[str]) -> str:
    """`train`, without the checks that refuse fp16 on a CPU (this forked rank only): the Trainer's, and
    DeepSpeed's on a CPU without oneDNN's fp16 (AMD's, for one). Torch's fp16 arithmetic runs on any CPU."""
    from deepspeed.accelerator import get_accelerator

    from megatron.config import run_inputs

    run_inputs._precision_problems = lambda cfg, device_name: []
    get_accelerator().is_fp16_supported = lambda: True
    return train(overrides)


def finite_norms_within(got: dict[int, dict], expected: dict[int, dict], tolerance: float) -> bool:
    """The same steps skipped (an infinite norm), the others' norms within `tolerance` (relative)."""
    skipped = [i for i in sorted(expected) if not math.isfinite(expected[i]["grad_norm"])]
    finite = {i: record for i, record in expected.items() if i not in skipped}
    return ([i for i in sorted(got) if not math.isfinite(got[i]["grad_norm"])] == skipped
            and max(relative_errors(got, finite, "grad_norm")) < tolerance)


@pytest.mark.parametrize(("ranks", "layout"), [
    pytest.param(2, ["extra_save_iters=[2]"], id="dp2-zero1"),
    pytest.param(2, ["zero_optimization={stage: 0}"], id="dp2-zero0"),
    pytest.param(2, ["bf16={enabled: true}"], id="dp2-bf16-zero1"),
    pytest.param(2, [FP16], id="dp2-fp16-zero1"),
    pytest.param(4, [], id="dp4-zero1"),
    pytest.param(4, ["zero_optimization={stage: 0}"], id="dp4-zero0"),
    pytest.param(4, ["model_parallel_size=2"], id="tp2-dp2-zero1"),
])
def test_without_clipping_the_lean_step_is_deepspeeds_bit_for_bit_and_saves_the_same_files(ranks, layout, demo_data,
                                                                                          tmp_path):
    common = (NO_CLIPPING, *DROPOUT, *layout)
    trainer = train_fp16_on_cpu if FP16 in layout else train
    lean_step, lean = run(tmp_path / "lean", demo_data, *common, ranks=ranks, trainer=trainer)
    deepspeed_step, deepspeed = run(tmp_path / "deepspeed", demo_data, *common, DEEPSPEED, ranks=ranks,
                                    trainer=trainer)
    assert (lean_step, deepspeed_step) == ("LeanStep", "partial")
    assert losses(lean) == losses(deepspeed)
    assert finite_norms_within(lean, deepspeed, 1e-6)  # the norm is logged, not applied
    step = f"checkpoints/global_step{ITERATIONS}"
    assert_same_checkpoint_files(tmp_path / "lean" / step, tmp_path / "deepspeed" / step)
    if "extra_save_iters=[2]" not in layout:
        return
    for writer, reader in (("lean", [DEEPSPEED]), ("deepspeed", [])):
        saved = tmp_path / f"resumed_from_{writer}"
        shutil.copytree(tmp_path / writer / "checkpoints" / "global_step2", saved / "global_step2")
        (saved / "latest").write_text("global_step2")
        _, resumed = run(tmp_path / f"{writer}_resumed", demo_data, *common, *reader, f"load={saved}", ranks=ranks)
        assert sorted(resumed) == [3, 4]
        assert [resumed[i]["lm_loss"] for i in (3, 4)] == [lean[i]["lm_loss"] for i in (3, 4)], writer


@pytest.mark.parametrize("layout", [pytest.param([], id="fp32"), pytest.param([FP16], id="fp16")])
def test_with_clipping_the_norm_and_losses_are_deepspeeds_within_fp32_rounding(layout, demo_data, tmp_path):
    """In fp16, within fp32 rounding up to the first update applied (both steps see the same fp16 weights), and
    within fp16's after it: the two updates' masters agree within fp32 rounding, but a master that close to a
    rounding boundary gives fp16 weights one fp16 unit apart (seen: a norm 4.2e-6 apart at the next step)."""
    trainer = train_fp16_on_cpu if FP16 in layout else train
    lean_step, lean = run(tmp_path / "lean", demo_data, *layout, ranks=2, trainer=trainer)
    _, deepspeed = run(tmp_path / "deepspeed", demo_data, *layout, DEEPSPEED, ranks=2, trainer=trainer)
    assert lean_step == "LeanStep"
    first_update = min(i for i in deepspeed if math.isfinite(deepspeed[i]["grad_norm"]))
    for iterations, tolerance in ((range(1, first_update + 1), 1e-6),
                                  (range(first_update + 1, ITERATIONS + 1), FP16_ROUNDING if FP16 in layout else 1e-6)):
        got, expected = ({i: records[i] for i in iterations} for records in (lean, deepspeed))
        if expected:
            assert finite_norms_within(got, expected, tolerance), (got, expected)
            assert max(relative_errors(got, expected, "lm_loss")) < tolerance, (got, expected)

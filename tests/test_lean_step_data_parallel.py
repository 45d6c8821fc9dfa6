"""The lean step (megatron/training/lean_step.py) on more than one data-parallel rank, against DeepSpeed's own step,
on tests/tiny.yml with real gloo processes (its gradients averaged by megatron/training/gradient_buckets.py):

- where the clipping factor is 1, the losses and the checkpoint files (flat masters, Adam moments and counters,
  partitioned as ZeRO-1 partitions them) are DeepSpeed's bit for bit at DP 2 and 4, with ZeRO-1 and stage 0, in
  bf16, and at TP 2 x DP 2; dropout is on, and a checkpoint either step wrote at DP 2 resumes on the other to
  the uninterrupted losses;
- where clipping scales, the norm and the losses are DeepSpeed's within fp32 rounding.
"""

from __future__ import annotations

import shutil

import pytest

from tests.test_lean_step import DEEPSPEED, ITERATIONS, NO_CLIPPING, assert_same_checkpoint_files, losses, \
    relative_errors, run

pytestmark = pytest.mark.slow

DROPOUT = ("hidden_dropout=0.1", "attention_dropout=0.1")


@pytest.mark.parametrize(("ranks", "layout"), [
    pytest.param(2, ["extra_save_iters=[2]"], id="dp2-zero1"),
    pytest.param(2, ["zero_optimization={stage: 0}"], id="dp2-zero0"),
    pytest.param(2, ["bf16={enabled: true}"], id="dp2-bf16-zero1"),
    pytest.param(4, [], id="dp4-zero1"),
    pytest.param(4, ["zero_optimization={stage: 0}"], id="dp4-zero0"),
    pytest.param(4, ["model_parallel_size=2"], id="tp2-dp2-zero1"),
])
def test_without_clipping_the_lean_step_is_deepspeeds_bit_for_bit_and_saves_the_same_files(ranks, layout, demo_data,
                                                                                          tmp_path):
    common = (NO_CLIPPING, *DROPOUT, *layout)
    lean_step, lean = run(tmp_path / "lean", demo_data, *common, ranks=ranks)
    deepspeed_step, deepspeed = run(tmp_path / "deepspeed", demo_data, *common, DEEPSPEED, ranks=ranks)
    assert (lean_step, deepspeed_step) == ("LeanStep", "partial")
    assert losses(lean) == losses(deepspeed)
    assert max(relative_errors(lean, deepspeed, "grad_norm")) < 1e-6  # the norm is logged, not applied
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


def test_with_clipping_the_norm_and_losses_are_deepspeeds_within_fp32_rounding(demo_data, tmp_path):
    lean_step, lean = run(tmp_path / "lean", demo_data, ranks=2)
    _, deepspeed = run(tmp_path / "deepspeed", demo_data, DEEPSPEED, ranks=2)
    assert lean_step == "LeanStep"
    assert max(relative_errors(lean, deepspeed, "grad_norm")) < 1e-6
    assert max(relative_errors(lean, deepspeed, "lm_loss")) < 1e-6

"""The lean training step (megatron/training/lean_step.py) against DeepSpeed's own step, on tests/tiny.yml with one
process (one data-parallel rank; `lean_step=false` forces DeepSpeed's step). The same code at DP 2 and 4, with
ZeRO stage 0, bf16 and resumes across the two steps: tests/test_lean_step_data_parallel.py.

- where the clipping factor is 1 (gradient_clipping 0), the fp32 loss curve is DeepSpeed's bit for bit with the
  plain engine and ZeRO-1 and with the pipeline engine (pipe_parallel_size 1); the checkpoint files hold the same
  tensors and values, bit for bit;
- with tiny.yml's clipping, the norm (multi-tensor, fp32) is DeepSpeed's (float64-accumulated) within fp32
  rounding, and so are the losses;
- which runs take the lean step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.config import load_config
from megatron.training.lean_step import lean_step_problem
from megatron.training.pretrain import Trainer
from tests.conftest import REPO, read_metrics
from tests.distributed import run_on_ranks

TINY = REPO / "tests" / "tiny.yml"
ITERATIONS = 4
NO_CLIPPING = "gradient_clipping=0"
DEEPSPEED = "lean_step=false"


def train(overrides: list[str]) -> str:
    world_size = dist.get_world_size()
    trainer = Trainer(load_config([TINY], [*overrides, f"num_gpus={world_size}"], world_size=world_size))
    trainer.train()
    trainer.metrics.close()
    return type(trainer.train_step).__name__


def run(run_dir: Path, demo_data: Path, *overrides: str, iterations: int = ITERATIONS, ranks: int = 1,
        trainer: Callable[[list[str]], str] = train) -> tuple[str, dict[int, dict]]:
    """`ranks` processes (one by default) of `iterations` iterations of tiny.yml with `trainer` (`train`),
    saving at the last: (the step they took, the train records of metrics.jsonl by iteration)."""
    step, *others = run_on_ranks(ranks, trainer, [
        f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json",
        f"train_iters={iterations}", f"lr_decay_iters={ITERATIONS}", "eval_interval=1000", "eval_iters=0",
        f"log_dir={run_dir}/logs", f"save={run_dir}/checkpoints", *overrides])
    assert all(other == step for other in others)
    return step, {r["iteration"]: r for r in read_metrics(run_dir / "logs") if r["split"] == "train"}


def losses(records: dict[int, dict]) -> list[float]:
    return [records[i]["lm_loss"] for i in sorted(records)]


def relative_errors(got: dict[int, dict], expected: dict[int, dict], key: str) -> list[float]:
    return [abs(got[i][key] - expected[i][key]) / abs(expected[i][key]) for i in sorted(expected)]


def differences(a, b, path: str = "") -> list[str]:
    """Where two loaded checkpoint files differ: a tensor's dtype, shape or any bit, a key, a value."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict):
        keys = [f"{path}/{key}: only in one" for key in a.keys() ^ b.keys()]
        return keys + [d for key in a.keys() & b.keys() for d in differences(a[key], b[key], f"{path}/{key}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} against {len(b)} entries"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if hasattr(a, "__dict__") and not isinstance(a, type):  # DeepSpeed's loss scaler
        return differences(vars(a), vars(b), path)
    return [] if a == b else [f"{path}: {a!r} against {b!r}"]


def assert_same_checkpoint_files(lean_dir: Path, deepspeed_dir: Path) -> None:
    lean = sorted(p.name for p in lean_dir.glob("*.pt"))
    assert lean == sorted(p.name for p in deepspeed_dir.glob("*.pt"))
    for name in lean:
        found = differences(torch.load(lean_dir / name, weights_only=False),
                            torch.load(deepspeed_dir / name, weights_only=False))
        assert not found, (name, found)


@pytest.mark.parametrize("layout", [
    pytest.param([], id="zero1"),
    pytest.param(["pipe_parallel_size=1"], id="pipeline-engine-zero1"),
])
@pytest.mark.slow
def test_without_clipping_the_lean_step_is_deepspeeds_bit_for_bit_and_saves_the_same_files(layout, demo_data,
                                                                                          tmp_path):
    lean_step, lean = run(tmp_path / "lean", demo_data, NO_CLIPPING, *layout)
    deepspeed_step, deepspeed = run(tmp_path / "deepspeed", demo_data, NO_CLIPPING, DEEPSPEED, *layout)
    assert (lean_step, deepspeed_step) == ("LeanStep", "partial")
    assert losses(lean) == losses(deepspeed)
    assert max(relative_errors(lean, deepspeed, "grad_norm")) < 1e-6  # the norm is logged, not applied
    step = f"checkpoints/global_step{ITERATIONS}"
    assert_same_checkpoint_files(tmp_path / "lean" / step, tmp_path / "deepspeed" / step)


@pytest.mark.slow
def test_with_clipping_the_norm_and_losses_are_deepspeeds_within_fp32_rounding(demo_data, tmp_path):
    _, lean = run(tmp_path / "lean", demo_data)
    _, deepspeed = run(tmp_path / "deepspeed", demo_data, DEEPSPEED)
    assert max(relative_errors(lean, deepspeed, "grad_norm")) < 1e-6
    assert max(relative_errors(lean, deepspeed, "lm_loss")) < 1e-6


def config(*overrides: str, world_size: int = 1):
    return load_config([TINY], [f"num_gpus={world_size}", *overrides], world_size=world_size)


def test_the_lean_step_is_taken_on_one_pipeline_stage_in_fp32_bf16_or_fp16_and_by_configs_1_5b_on_8_gpus():
    assert lean_step_problem(config(), "cpu") is None
    assert lean_step_problem(config(world_size=8), "cpu") is None
    assert lean_step_problem(config("fp16={enabled: true}", world_size=2), "cpu") is None
    assert lean_step_problem(load_config([REPO / "configs" / "1-5B.yml"], [], world_size=8), "cpu") is None
    assert lean_step_problem(config("pipe_parallel_size=1", "bf16={enabled: true}"), "cpu") is None
    assert lean_step_problem(config("zero_optimization={stage: 0}"), "cpu") is None
    assert lean_step_problem(config("model_parallel_size=2", world_size=2), "cpu") is None
    refused = {
        "lean_step is false": config("lean_step=false"),
        "pipe_parallel_size 2": config("pipe_parallel_size=2", world_size=2),
        "ZeRO stage 2": config("zero_optimization={stage: 2}"),
        "ZeRO stage 0 in bfloat16": config("zero_optimization={stage: 0}", "bf16={enabled: true}"),
        "zero_optimization.offload_optimizer": config("zero_optimization={stage: 1, offload_optimizer: "
                                                      "{device: cpu}}"),
    }
    for reason, refused_config in refused.items():
        problem = lean_step_problem(refused_config, "cpu")
        assert problem is not None and reason in problem, (reason, problem)


@pytest.mark.parametrize("device_type", ["hpu", "npu", "mlu"])
def test_a_device_without_torchs_fused_adamw_takes_deepspeeds_step(device_type):
    """There the optimizer is built with fused=None and LeanStep refused it: the run chose the lean step and
    then failed, rather than taking DeepSpeed's."""
    assert lean_step_problem(config(), device_type) == (
        f"torch has no fused AdamW on {device_type}, which the lean step needs to skip a step on the device")

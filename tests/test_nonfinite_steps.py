"""Non-finite steps in the real training loop (2 gloo ranks): an infinite gradient and a NaN loss are
skipped on every rank without touching the weights or the optimizer state, under ZeRO stage 0 (our optimizer
hook) and stage 1 (DeepSpeed's check) at 2 data-parallel ranks, and in the lean step (2 tensor-parallel ranks,
one data-parallel rank); too many in a row stop the run, the last checkpoint intact."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron.checkpoint.selection import checkpoint_problems
from megatron.config import load_config
from megatron.training.numerics import NonFiniteTrainingError
from megatron.training.pretrain import Trainer
from tests.distributed import run_on_ranks
from tests.test_tensor_parallel_training import TINY

pytestmark = pytest.mark.slow


def tensors_of(value) -> list[torch.Tensor]:
    """Every tensor inside a (nested) state dict, copied, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value.detach().clone()]
    if isinstance(value, dict):
        return [t for key in sorted(value, key=str) for t in tensors_of(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_of(item)]
    return []


def same(left: list[torch.Tensor], right: list[torch.Tensor]) -> bool:
    return len(left) == len(right) and all(torch.equal(a, b) for a, b in zip(left, right))


def poison(trainer: Trainer, nan_loss_at: set[int], inf_grad_at: set[int]) -> None:
    """Make the loss NaN (the logits) or the gradient of one weight infinite at the given iterations."""
    model, state = trainer.engine.module, trainer.state

    def logits_hook(module, inputs, output):
        return output * math.nan if state.iteration + 1 in nan_loss_at else output

    model.register_forward_hook(logits_hook)
    next(model.parameters()).register_hook(lambda grad: grad * math.inf if state.iteration + 1 in inf_grad_at else grad)


def train_recording_steps(overrides: list[str], nan_loss_at: set[int], inf_grad_at: set[int]) -> dict:
    """Train with poisoned iterations; after each step, whether the weights and the optimizer state changed."""
    cfg = load_config([TINY], [*overrides, f"num_gpus={dist.get_world_size()}"], world_size=dist.get_world_size())
    trainer = Trainer(cfg)
    poison(trainer, nan_loss_at, inf_grad_at)
    engine, check = trainer.engine, trainer.nonfinite_steps.check
    changed = {}

    def snapshot() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return tensors_of(dict(engine.module.named_parameters())), tensors_of(engine.optimizer.state_dict())

    before = snapshot()

    def check_and_compare(iteration: int, loss: float, grad_norm: float | None) -> None:
        nonlocal before
        try:
            check(iteration, loss, grad_norm)
        finally:
            after = snapshot()
            changed[iteration] = {"weights": not same(before[0], after[0]), "optimizer": not same(before[1], after[1]),
                                  "loss": loss, "grad_norm": grad_norm}
            before = after

    trainer.nonfinite_steps.check = check_and_compare
    try:
        trainer.train()
    except NonFiniteTrainingError as error:
        return {"changed": changed, "error": str(error), "skipped": trainer.nonfinite_steps.total}
    return {"changed": changed, "error": None, "skipped": trainer.nonfinite_steps.total}


def run(tmp_path, demo_data, *overrides: str, nan_loss_at=(), inf_grad_at=()) -> list[dict]:
    return run_on_ranks(2, train_recording_steps, [
        f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json", "eval_iters=0",
        "eval_interval=1000", f"log_dir={tmp_path}/logs", *overrides], set(nan_loss_at), set(inf_grad_at))


@pytest.mark.parametrize("layout", [
    pytest.param(["zero_optimization={stage: 0}"], id="data-2-stage-0"),
    pytest.param(["zero_optimization={stage: 1}"], id="data-2-stage-1"),
    # one data-parallel rank: the lean step, which skips on the device (megatron/training/lean_step.py)
    pytest.param(["zero_optimization={stage: 0}", "model_parallel_size=2"], id="lean-tensor-2-stage-0"),
    pytest.param(["zero_optimization={stage: 1}", "model_parallel_size=2"], id="lean-tensor-2-stage-1"),
])
def test_infinite_gradient_and_nan_loss_are_skipped_without_touching_any_state(layout, demo_data, tmp_path):
    results = run(tmp_path, demo_data, "train_iters=5", "lr_decay_iters=5", *layout, inf_grad_at={2}, nan_loss_at={4})
    for rank_result in results:
        changed = rank_result["changed"]
        assert rank_result["error"] is None and rank_result["skipped"] == 2
        assert math.isfinite(changed[2]["loss"]) and not math.isfinite(changed[2]["grad_norm"])
        assert math.isnan(changed[4]["loss"])
        for iteration in (2, 4):
            assert not changed[iteration]["weights"] and not changed[iteration]["optimizer"], (iteration, changed)
        for iteration in (1, 3, 5):
            assert changed[iteration]["weights"] and changed[iteration]["optimizer"], (iteration, changed)


def test_too_many_bad_steps_in_a_row_stop_the_run_with_the_last_checkpoint_intact(demo_data, tmp_path):
    results = run(tmp_path, demo_data, "train_iters=20", "lr_decay_iters=20", "max_skipped_steps=3",
                  f"save={tmp_path}/checkpoints", "checkpoint_factor=4", nan_loss_at=range(6, 21))
    for rank_result in results:
        assert sorted(rank_result["changed"]) == list(range(1, 9)) and rank_result["skipped"] == 3
        assert "stopping at iteration 8: 3 steps in a row had a non-finite loss" in rank_result["error"]
        assert "max_skipped_steps=3" in rank_result["error"]
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text() == "global_step4"
    assert sorted(p.name for p in checkpoints.glob("global_step*")) == ["global_step4"]
    assert checkpoint_problems(checkpoints / "global_step4") == []

"""The real training loop (megatron.training.pretrain.Trainer: DeepSpeed's pipeline engine, ZeRO, clipping,
evaluation, checkpoints) with pipeline parallelism, on gloo processes forked in-process.

Against the single-stage run (plain model, one process, 4 micro-batches per step: the lean step), over 20
iterations: PP=1 (DeepSpeed's pipeline engine with one stage, lean_step off), PP=2, TP=2 × PP=2 and DP=2 × PP=2
track the training losses, gradient norms and validation losses within 1e-3 relative. ZeRO-1 at DP=2 × PP=2
holds half the optimizer state per rank of PP=2. bf16 trains under PP=2. Activation checkpointing under TP=2 × PP=2 replays dropout
exactly. PP=2 and TP=2 × PP=2 runs with dropout save per-layer checkpoints and resume bitwise.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.config import load_config
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.pipeline import model_parameter_name
from megatron.training.pretrain import Trainer
from tests.conftest import REPO, read_metrics
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.slow

TINY = REPO / "tests" / "tiny.yml"
RELATIVE_TOLERANCE = 1e-3
ITERATIONS = 20
PIPE_2 = "pipe_parallel_size=2"
ZERO_0 = "zero_optimization={stage: 0}"
DROPOUT = ("hidden_dropout=0.1", "attention_dropout=0.1")


def train(overrides: list[str]) -> dict:
    """One rank of the training loop on tests/tiny.yml; what this rank's engine holds."""
    world_size = dist.get_world_size()
    trainer = Trainer(load_config([TINY], [*overrides, f"num_gpus={world_size}"], world_size=world_size))
    trainer.train()
    trainer.metrics.close()
    moments = [t for state in trainer.optimizer.state.values() for t in state.values() if t.dim() > 0]
    return {"engine": type(trainer.engine).__name__,
            "dtype": next(trainer.engine.module.parameters()).dtype,
            "optimizer_state_bytes": sum(t.numel() * t.element_size() for t in moments)}


@dataclass
class Run:
    train: dict[int, dict]   # metrics.jsonl train records by iteration
    valid: dict[int, dict]
    ranks: list[dict]        # train()'s result on each rank


def run(world_size: int, run_dir: Path, demo_data: Path, *overrides: str, iterations: int = ITERATIONS) -> Run:
    """Train `iterations` of the 20-iteration schedule on `world_size` ranks, validating on 2 global batches
    every 10 iterations."""
    ranks = run_on_ranks(world_size, train, [
        f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json",
        f"train_iters={iterations}", f"lr_decay_iters={ITERATIONS}", "eval_interval=10", "eval_iters=2",
        f"log_dir={run_dir}/logs", *overrides])
    records = read_metrics(run_dir / "logs")
    by_split = {split: {r["iteration"]: r for r in records if r["split"] == split} for split in ("train", "valid")}
    return Run(by_split["train"], by_split["valid"], ranks)


def relative_errors(got: dict[int, dict], expected: dict[int, dict], key: str) -> dict[int, float]:
    return {i: abs(got[i][key] - expected[i][key]) / abs(expected[i][key]) for i in got}


def assert_tracks(got: Run, expected: Run) -> None:
    assert sorted(got.train) == sorted(expected.train) == list(range(1, ITERATIONS + 1))
    assert sorted(got.valid) == sorted(expected.valid) == [10, 20]
    for split, key in (("train", "lm_loss"), ("train", "grad_norm"), ("valid", "lm_loss")):
        errors = relative_errors(getattr(got, split), getattr(expected, split), key)
        assert max(errors.values()) < RELATIVE_TOLERANCE, (split, key, errors)


@pytest.fixture(scope="module")
def single_stage(demo_data, tmp_path_factory) -> Run:
    """The plain model on one process: each step is 4 micro-batches of 4 sequences."""
    reference = run(1, tmp_path_factory.mktemp("single_stage"), demo_data, "gradient_accumulation_steps=4")
    assert reference.ranks[0]["engine"] == "DeepSpeedEngine"
    return reference


@pytest.fixture(scope="module")
def pipe_2(demo_data, tmp_path_factory) -> Run:
    return run(2, tmp_path_factory.mktemp("pipe_2"), demo_data, PIPE_2, "gradient_accumulation_steps=4")


@pytest.fixture(scope="module")
def data_2_pipe_2(demo_data, tmp_path_factory) -> Run:
    """The same global batch: 2 micro-batches on each of 2 data-parallel pipelines."""
    return run(4, tmp_path_factory.mktemp("data_2_pipe_2"), demo_data, PIPE_2, "gradient_accumulation_steps=2")


def test_pipeline_engine_with_one_stage_tracks_the_plain_model(single_stage, demo_data, tmp_path):
    one_stage = run(1, tmp_path, demo_data, "pipe_parallel_size=1", ZERO_0, "gradient_accumulation_steps=4",
                    "lean_step=false")  # one process would take the lean step (tests/test_lean_step.py)
    assert one_stage.ranks[0]["engine"] == "PipelineEngine"
    assert_tracks(one_stage, single_stage)


def test_two_stages_track_the_single_stage_run(single_stage, pipe_2):
    assert [r["engine"] for r in pipe_2.ranks] == ["PipelineEngine"] * 2
    assert_tracks(pipe_2, single_stage)


def test_tensor_2_by_pipe_2_tracks_the_single_stage_run_under_zero_stage_0(single_stage, demo_data, tmp_path):
    # ZeRO stage 0 in fp32: the gradient norm and clipping of gradient_clipping.py, over tensor and pipe ranks
    tensor_2_pipe_2 = run(4, tmp_path, demo_data, PIPE_2, "model_parallel_size=2", ZERO_0,
                          "gradient_accumulation_steps=4")
    assert_tracks(tensor_2_pipe_2, single_stage)


def test_data_2_by_pipe_2_tracks_the_single_stage_run(single_stage, data_2_pipe_2):
    assert_tracks(data_2_pipe_2, single_stage)


def test_zero_1_at_data_parallel_2_holds_half_the_optimizer_state_per_rank(pipe_2, data_2_pipe_2):
    # ranks are (pipe, data)-ordered: PP=2 has stage 0, 1; DP=2 × PP=2 has stage 0, 0, 1, 1
    for stage, alone in enumerate(r["optimizer_state_bytes"] for r in pipe_2.ranks):
        for shared in (r["optimizer_state_bytes"] for r in data_2_pipe_2.ranks[2 * stage: 2 * stage + 2]):
            assert 0.45 < shared / alone < 0.55, (stage, shared, alone)


def test_bf16_trains_with_two_stages(single_stage, demo_data, tmp_path):
    bf16 = run(2, tmp_path, demo_data, PIPE_2, "bf16={enabled: true}", "gradient_accumulation_steps=4", iterations=5)
    assert [r["dtype"] for r in bf16.ranks] == [torch.bfloat16] * 2
    errors = relative_errors(bf16.train, single_stage.train, "lm_loss")
    assert sorted(errors) == list(range(1, 6)) and max(errors.values()) < 1e-2, errors


def layer_files(step_dir: Path) -> set[str]:
    return {p.name for p in step_dir.glob("layer_*-model_states.pt")}


def resume_bitwise(demo_data: Path, tmp_path: Path, world_size: int, *overrides: str) -> Path:
    """Train 4 iterations saving at 2, resume a copy of step 2, and compare iterations 3-4 bitwise; the
    uninterrupted run's step-2 directory."""
    run_dir = tmp_path / "uninterrupted"
    uninterrupted = run(world_size, run_dir, demo_data, *overrides, f"save={run_dir}/checkpoints",
                        "extra_save_iters=[2]", iterations=4)
    step_2 = run_dir / "checkpoints" / "global_step2"
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(step_2, resumed_dir / "global_step2")
    (resumed_dir / "latest").write_text("global_step2")
    resumed = run(world_size, tmp_path, demo_data, *overrides, f"load={resumed_dir}", f"save={resumed_dir}",
                  iterations=4)
    assert sorted(resumed.train) == [3, 4]
    assert all(resumed.train[i]["lm_loss"] == uninterrupted.train[i]["lm_loss"] for i in resumed.train), [
        (i, resumed.train[i]["lm_loss"], uninterrupted.train[i]["lm_loss"]) for i in resumed.train]
    return step_2


def test_two_stages_save_deepspeed_per_layer_files_and_resume_bitwise(demo_data, tmp_path):
    step_2 = resume_bitwise(demo_data, tmp_path, 2, PIPE_2, *DROPOUT)
    # tiny.yml has 2 layers: embedding 0, TokenFormer layers 2-3, final norm 5; the tied output (6) has no file
    assert layer_files(step_2) == {f"layer_{i:02d}-model_00-model_states.pt" for i in (0, 2, 3, 5)}
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= {p.name for p in step_2.iterdir()}
    # their keys are the single-stage model's state_dict, renamed as documented in megatron/model/pipeline.py
    args = TokenFormerArgs.from_config(load_config([TINY]), padded_vocab_size=64)
    saved = {model_parameter_name(int(path.name[len("layer_"):][:2]), key, args.num_layers)
             for path in step_2.glob("layer_*") for key in torch.load(path, weights_only=True)}
    assert saved == set(TokenFormerModel(args, device="meta").state_dict())


def test_tensor_2_by_pipe_2_saves_a_file_per_layer_and_tensor_rank_and_resumes_bitwise(demo_data, tmp_path):
    step_2 = resume_bitwise(demo_data, tmp_path, 4, PIPE_2, "model_parallel_size=2", *DROPOUT)
    assert layer_files(step_2) == {f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in (0, 2, 3, 5) for t in (0, 1)}


def test_activation_checkpointing_replays_dropout_under_tensor_and_pipe_parallelism(demo_data, tmp_path):
    layout = (PIPE_2, "model_parallel_size=2", *DROPOUT)
    stored = run(4, tmp_path / "stored", demo_data, *layout, iterations=2)
    recomputed = run(4, tmp_path / "recomputed", demo_data, *layout, "checkpoint_activations=true", iterations=2)
    errors = relative_errors(recomputed.train, stored.train, "lm_loss")
    assert max(errors.values()) < 1e-6, errors

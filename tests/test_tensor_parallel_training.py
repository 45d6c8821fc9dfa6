"""The real training loop (megatron.training.pretrain: DeepSpeed engine, ZeRO, clipping, checkpoints) with
tensor parallelism, on gloo processes forked in-process: 20 iterations at TP=2 track TP=1, DP=2 × TP=2
tracks DP=2, and a TP=2 run with dropout saves per-rank shards and resumes bitwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron.config import load_config
from megatron.training import pretrain
from tests.conftest import REPO, read_metrics
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.slow

TINY = REPO / "tests" / "tiny.yml"
RELATIVE_TOLERANCE = 1e-3


def train(overrides: list[str]) -> None:
    """One rank of `pretrain` on tests/tiny.yml with `overrides`, for as many processes as were started."""
    world_size = dist.get_world_size()
    pretrain(load_config([TINY], [*overrides, f"num_gpus={world_size}"], world_size=world_size))


def run(world_size: int, run_dir: Path, demo_data: Path, *overrides: str) -> dict[int, dict]:
    """Train 20 iterations on `world_size` ranks; train records of metrics.jsonl by iteration."""
    run_on_ranks(world_size, train, [
        f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json",
        "train_iters=20", "lr_decay_iters=20", "eval_iters=0", "eval_interval=1000", f"log_dir={run_dir}/logs",
        *overrides])
    return {r["iteration"]: r for r in read_metrics(run_dir / "logs") if r["split"] == "train"}


def assert_tracks(got: dict[int, dict], expected: dict[int, dict]) -> None:
    assert sorted(got) == sorted(expected) == list(range(1, 21))
    for key in ("lm_loss", "grad_norm"):
        errors = {i: abs(got[i][key] - expected[i][key]) / abs(expected[i][key]) for i in expected}
        assert max(errors.values()) < RELATIVE_TOLERANCE, (key, errors)


def test_tensor_parallel_2_tracks_a_single_rank_run(demo_data, tmp_path):
    assert_tracks(run(2, tmp_path / "tp2", demo_data, "model_parallel_size=2"), run(1, tmp_path / "tp1", demo_data))


def test_data_2_by_tensor_2_tracks_data_parallel_2_under_zero_stage_0(demo_data, tmp_path):
    stage_0 = "zero_optimization={stage: 0}"
    dp2 = run(2, tmp_path / "dp2", demo_data, stage_0)
    dp2_tp2 = run(4, tmp_path / "dp2_tp2", demo_data, stage_0, "model_parallel_size=2")
    assert_tracks(dp2_tp2, dp2)


def test_checkpoint_has_one_model_file_per_tensor_rank_and_resumes_bitwise(demo_data, tmp_path):
    # dropout on the split attention heads draws from the per-rank stream, which the checkpoint must restore
    tp2_with_dropout = ("model_parallel_size=2", "attention_dropout=0.1", "hidden_dropout=0.1")
    run_dir = tmp_path / "uninterrupted"
    uninterrupted = run(2, run_dir, demo_data, *tp2_with_dropout, f"save={run_dir}/checkpoints",
                        "extra_save_iters=[10]")
    step_10 = run_dir / "checkpoints" / "global_step10"
    assert {p.name for p in step_10.glob("mp_rank_*_model_states.pt")} == {
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"}
    resumed_dir = tmp_path / "checkpoints"
    resumed_dir.mkdir()
    shutil.copytree(step_10, resumed_dir / "global_step10")
    (resumed_dir / "latest").write_text("global_step10")
    resumed = run(2, tmp_path, demo_data, *tp2_with_dropout, f"load={resumed_dir}", f"save={resumed_dir}")
    assert sorted(resumed) == list(range(11, 21))
    assert all(resumed[i]["lm_loss"] == uninterrupted[i]["lm_loss"] for i in resumed), [
        (i, resumed[i]["lm_loss"], uninterrupted[i]["lm_loss"]) for i in resumed]
    saved_config = json.loads((step_10 / "config.json").read_text())
    assert saved_config["model_parallel_size"] == 2

"""A checkpoint resumes on another layout with nothing of its state lost (docs/cluster.md, "When your allocation
changes"), on forked gloo ranks with the real Trainer (tests/tiny.yml, fp32, ZeRO-1, a global batch of 16).

One run that never changes layout is the reference: 32 iterations on TP 1 × PP 0 × DP 2, saving at iteration 3.
A chain of resumes in one save directory continues from that checkpoint, each stage on another layout, set up
as deepy.py sets it up (the global batch kept, the checkpoint re-sharded beside the original), each stage's
losses against the reference's at the same iterations: DP 2 → 1 and DP 1 → 2 (10 iterations each, 1e-6), then
TP 1 → TP 2 × PP 1, TP 2 × PP 1 → TP 1 × PP 2, TP 1 × PP 2 → TP 2 × PP 1 (3 each, 1e-5). A stage that lost
Adam's moments or step, the data position or the global batch would differ from the reference at once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron.checkpoint.commit import LATEST, write_durably
from megatron.config import load_config
from megatron.config.loader import keys_set
from megatron.launch.global_batch import kept_batch_note, kept_batch_override
from megatron.launch.preflight import reshard_before_launch
from megatron.training.pretrain import Trainer
from tests.conftest import REPO
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.slow

TINY = REPO / "tests" / "tiny.yml"
TRAIN_ITERS = 32  # every run's: one learning-rate schedule


def values(demo_data: Path, directory: Path, log_dir: Path, layout: dict, save_at: int) -> list[str]:
    given = {"data_path": f"{demo_data}/demo_text_document", "vocab_file": f"{demo_data}/tokenizer.json",
             "train_iters": TRAIN_ITERS, "eval_interval": 1000, "eval_iters": 1, "load": str(directory),
             "save": str(directory), "log_dir": str(log_dir), "extra_save_iters": [save_at],
             "user_script": "train.py", **layout}
    return [f"{key}={json.dumps(value)}" for key, value in given.items()]


def train_until(overrides: list[str], world: int, until: int) -> int:
    """One rank: the Trainer of `overrides` trained to iteration `until` (saving there); its first iteration."""
    trainer = Trainer(load_config([TINY], overrides, world_size=world))
    start = trainer.state.iteration
    trainer.train(until)
    trainer.metrics.close()
    return start


def launch(overrides: list[str], world: int, until: int) -> tuple[list[str], int]:
    """As deepy.py launches: the config resolved with the global batch kept, the checkpoint re-sharded; the
    lines deepy.py prints of it, and the ranks' first iteration."""
    overrides = [*overrides, f"num_gpus={world}"]
    cfg = load_config([TINY], overrides, world_size=world)
    kept = kept_batch_override(cfg, keys_set([TINY], overrides))
    if kept:
        overrides.append(kept)
        cfg = load_config([TINY], overrides, world_size=world)
    lines = [line for line in (kept_batch_note(cfg), reshard_before_launch(cfg, world)) if line]
    return lines, run_on_ranks(world, train_until, overrides, world, until)[0]


def train_losses(log_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["iteration"]: record["lm_loss"] for record in records if record["split"] == "train"}


@pytest.fixture(scope="module")
def reference(demo_data, tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The run that never changes layout, and its checkpoint at iteration 3 alone in a save directory."""
    directory = tmp_path_factory.mktemp("reference")
    run_on_ranks(2, train_until, values(demo_data, directory / "save", directory / "logs", {}, 3), 2, TRAIN_ITERS)
    start = tmp_path_factory.mktemp("resumed")
    shutil.copytree(directory / "save" / "global_step3", start / "global_step3")
    write_durably(start / LATEST, "global_step3")
    return start, train_losses(directory / "logs")


CHAIN = [  # (layout, processes, iterations, tolerance)
    ({}, 1, 10, 1e-6),
    ({}, 2, 10, 1e-6),
    ({"model_parallel_size": 2, "pipe_parallel_size": 1}, 2, 3, 1e-5),
    ({"model_parallel_size": 1, "pipe_parallel_size": 2}, 2, 3, 1e-5),
    ({"model_parallel_size": 2, "pipe_parallel_size": 1}, 2, 3, 1e-5),
]


def test_a_checkpoint_resumes_on_every_other_layout_with_the_losses_of_the_unchanged_run(demo_data, reference,
                                                                                        tmp_path):
    directory, expected = reference
    iteration, said = 3, []
    for stage, (layout, world, steps, tolerance) in enumerate(CHAIN):
        log_dir = tmp_path / f"logs{stage}"
        lines, start = launch(values(demo_data, directory, log_dir, layout, iteration + steps), world, iteration + steps)
        said.append(lines)
        losses = train_losses(log_dir)
        assert start == iteration and min(losses) == iteration + 1, (stage, start, losses)
        for step, loss in losses.items():
            assert abs(loss - expected[step]) <= tolerance * abs(expected[step]), (stage, step, loss, expected[step])
        iteration += steps
    assert said[0] == [
        f"gradient_accumulation_steps 4 (saved 2): {directory}/global_step3 was trained on 2 data-parallel ranks, "
        "this run has 1; its global batch of 16 sequences is kept",
        "resuming global_step3 (TP 1 × PP 0 × DP 2) as TP 1 × PP 0 × DP 1: re-sharded into global_step3-tp1pp0dp1"]
    assert said[3][-1] == ("resuming global_step26 (TP 2 × PP 1 × DP 1) as TP 1 × PP 2 × DP 1: re-sharded into "
                           "global_step26-tp1pp2dp1")
    originals = sorted(path.name for path in directory.iterdir() if path.is_dir())
    assert originals == ["global_step13", "global_step13-tp1pp0dp2", "global_step23", "global_step23-tp2pp1dp1",
                         "global_step26", "global_step26-tp1pp2dp1", "global_step29", "global_step29-tp2pp1dp1",
                         "global_step3", "global_step3-tp1pp0dp1", "global_step32"]

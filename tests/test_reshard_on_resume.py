"""A checkpoint resumes on another layout with nothing of its state lost (docs/cluster.md, "When your allocation
changes"), on forked gloo ranks with the real Trainer (tests/tiny.yml, fp32, ZeRO-1, a global batch of 16).

One run that never changes layout is the reference: 32 iterations on TP 1 × PP 0 × DP 2, saving at iteration 3.
A chain of resumes in one save directory continues from that checkpoint, each stage on another layout, set up
as deepy.py sets it up (the global batch kept, the checkpoint re-sharded beside the original; once, as a launch
without deepy.py, by rank 0 while the other rank waits), each stage's
losses against the reference's at the same iterations: DP 2 → 1 and DP 1 → 2 (10 iterations each, 1e-6), then
TP 1 → TP 2 × PP 1, TP 2 × PP 1 → TP 1 × PP 2, TP 1 × PP 2 → TP 2 × PP 1 (3 each, 1e-5). A stage that lost
Adam's moments or step, the data position or the global batch would differ from the reference at once.

In one process (a checkpoint written directly, test_growth_keeps_state's): a preserve-grown checkpoint mid-ramp
re-sharded keeps its n and computes the same logits; a re-shard killed (SIGKILL) midway leaves the original
intact and the same call redoes it, then reuses it. The refusals are one line each, before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.commit import LATEST, write_durably
from megatron.checkpoint.growth_record import read_growth_record
from megatron.checkpoint.manifest import content_digest
from megatron.checkpoint.selection import verified_file_problems
from megatron.config import Config, ConfigError, load_config
from megatron.config.loader import keys_set
from megatron.launch.global_batch import kept_batch_note, kept_batch_override
from megatron.launch.preflight import reshard_before_launch
from megatron.inference.loading import load_model
from megatron.training.pretrain import Trainer
from tests.conftest import REPO
from tests.distributed import run_on_ranks
from tests.test_growth_keeps_state import (DOUBLED, MID, START, VOCAB, held_norms, mid_ramp_checkpoint, overrides,
                                           without_growth_mode)

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


def launch(overrides: list[str], world: int, until: int, reshard_before: bool) -> tuple[list[str], int]:
    """As deepy.py launches: the config resolved with the global batch kept, the checkpoint re-sharded (or, not
    `reshard_before`, as a launch without deepy.py: rank 0 re-shards); the lines deepy.py prints of it, and the
    ranks' first iteration."""
    overrides = [*overrides, f"num_gpus={world}"]
    cfg = load_config([TINY], overrides, world_size=world)
    kept = kept_batch_override(cfg, keys_set([TINY], overrides))
    if kept:
        overrides.append(kept)
        cfg = load_config([TINY], overrides, world_size=world)
    lines = [kept_batch_note(cfg), reshard_before_launch(cfg, world) if reshard_before else None]
    return [line for line in lines if line], run_on_ranks(world, train_until, overrides, world, until)[0]


def train_losses(log_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["iteration"]: record["lm_loss"] for record in records if record["split"] == "train"}


@pytest.fixture(scope="module")
def reference(demo_data, tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The run that never changes layout: its save directory (a checkpoint at iteration 3 among others) and losses."""
    directory = tmp_path_factory.mktemp("reference")
    run_on_ranks(2, train_until, values(demo_data, directory / "save", directory / "logs", {}, 3), 2, TRAIN_ITERS)
    return directory / "save", train_losses(directory / "logs")


def resumable_at_3(reference_save: Path, directory: Path) -> Path:
    """A save directory holding the reference's checkpoint at iteration 3 alone (TP 1 × PP 0 × DP 2, ZeRO-1)."""
    shutil.copytree(reference_save / "global_step3", directory / "global_step3")
    write_durably(directory / LATEST, "global_step3")
    return directory


CHAIN = [  # (layout, processes, iterations, tolerance, re-sharded before launch: else by rank 0)
    ({}, 1, 10, 1e-6, True),
    ({}, 2, 10, 1e-6, False),
    ({"model_parallel_size": 2, "pipe_parallel_size": 1}, 2, 3, 1e-5, True),
    ({"model_parallel_size": 1, "pipe_parallel_size": 2}, 2, 3, 1e-5, True),
    ({"model_parallel_size": 2, "pipe_parallel_size": 1}, 2, 3, 1e-5, True),
]


def test_a_checkpoint_resumes_on_every_other_layout_with_the_losses_of_the_unchanged_run(demo_data, reference,
                                                                                        tmp_path):
    directory, expected = resumable_at_3(reference[0], tmp_path / "save"), reference[1]
    iteration, said = 3, []
    for stage, (layout, world, steps, tolerance, before) in enumerate(CHAIN):
        log_dir, until = tmp_path / f"logs{stage}", iteration + steps
        lines, start = launch(values(demo_data, directory, log_dir, layout, until), world, until, before)
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


def tp2_resume_of(save: Path, base: Path, *extra: str) -> Config:
    """The config of a 2-process TP 2 run resuming `save` (a mid-ramp checkpoint of test_growth_keeps_state)."""
    return load_config([base], [f"padded_vocab_size={VOCAB}", "norm_token_count_ramp_iters=8", *overrides(DOUBLED),
                                f"load={save}", "model_parallel_size=2", "num_gpus=2", "user_script=train.py",
                                *extra], world_size=2)


def test_a_mid_ramp_checkpoint_re_sharded_keeps_its_n_and_computes_what_the_source_computes(tmp_path):
    base = without_growth_mode(tmp_path)
    source = mid_ramp_checkpoint(tmp_path / "save", base)
    cfg = tp2_resume_of(source.parent, base)
    assert reshard_before_launch(cfg, 2) == ("resuming global_step4 (TP 1 × PP 0) as TP 2 × PP 0 × DP 1: "
                                             "re-sharded into global_step4-tp2pp0dp1")
    copy = source.parent / "global_step4-tp2pp0dp1"
    assert held_norms(copy) == MID and read_growth_record(copy)["norm_token_count"] == START
    tokens = torch.randint(0, 2000, (2, 16))
    with torch.no_grad():
        assert torch.equal(load_model(copy)(tokens), load_model(source)(tokens))
    assert (source.parent / LATEST).read_text().strip() == "global_step4"  # the original is still the one named


def reshard_in_a_process(cfg: Config) -> subprocess.Popen:
    """deepy.py's re-shard of `cfg`'s checkpoint in a process of its own, to be killed."""
    code = ("import sys; from megatron.config import Config; from megatron.launch.preflight import "
            "reshard_before_launch; print(reshard_before_launch(Config.from_json(sys.stdin.read()), 2), flush=True)")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    process.stdin.write(cfg.to_json())
    process.stdin.close()
    return process


def wider(base: Path) -> Path:
    """`base` with 8 layers of width 1024 (~20M parameters): a re-shard long enough (about a second) to be
    killed midway every time."""
    text = base.read_text().replace("num_layers: 2\n", "num_layers: 8\n").replace("hidden_size: 64\n",
                                                                                   "hidden_size: 1024\n")
    path = base.with_name("wider.yml")
    path.write_text(text, encoding="utf-8")
    return path


def test_a_re_shard_killed_midway_leaves_the_original_and_the_same_command_redoes_it_then_reuses_it(tmp_path):
    base = wider(without_growth_mode(tmp_path))
    source = mid_ramp_checkpoint(tmp_path / "save", base)
    digest, cfg = content_digest(source), tp2_resume_of(source.parent, base)
    work = source.parent / ".tmp-reshard-global_step4-tp2pp0dp1"
    process = reshard_in_a_process(cfg)
    deadline = time.monotonic() + 120
    while not any(work.rglob("*.pt")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL and work.is_dir(), "killed after it finished: nothing was tested"
    assert not (source.parent / "global_step4-tp2pp0dp1").exists() and content_digest(source) == digest
    assert verified_file_problems(source) == []
    assert reshard_before_launch(cfg, 2).endswith(": re-sharded into global_step4-tp2pp0dp1") and not work.exists()
    assert reshard_before_launch(cfg, 2).endswith(": re-sharded before, reusing global_step4-tp2pp0dp1")
    next((source.parent / "global_step4-tp2pp0dp1").glob("*.pt")).unlink()  # a copy damaged since
    assert reshard_before_launch(cfg, 2).endswith(": re-sharded into global_step4-tp2pp0dp1")
    assert verified_file_problems(source.parent / "global_step4-tp2pp0dp1") == [] and held_norms(source) == MID
    assert reshard_before_launch(tp2_resume_of(source.parent, base, "reshard_on_resume=false"), 2) is None


def test_each_refusal_is_one_line_before_anything_is_written(demo_data, reference, tmp_path, monkeypatch):
    """A data-parallel size that no whole gradient_accumulation_steps fits (the global batch is 16, micro batches
    4), and too little free space for the re-shard."""
    directory = resumable_at_3(reference[0], tmp_path / "save")
    written = sorted(directory.rglob("*"))
    resume = values(demo_data, directory, tmp_path / "logs", {}, 4)
    cfg = load_config([TINY], [*resume, "num_gpus=3"], world_size=3)
    with pytest.raises(ConfigError) as refused:
        kept_batch_override(cfg, keys_set([TINY], resume))
    assert str(refused.value) == (
        f"load: {directory}/global_step3 was trained with a global batch of 16 sequences (train_batch_size), which "
        "3 data-parallel ranks of train_micro_batch_size_per_gpu 4 cannot make in whole micro batches: resume on a "
        "data-parallel size in [1, 2, 4] ([1, 2, 4] processes at TP × PP = 1), or set train_batch_size to change the "
        "global batch")
    cfg = load_config([TINY], [*resume, "num_gpus=1", "gradient_accumulation_steps=4"], world_size=1)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**40, 2**40, 2**20))
    with pytest.raises(ConfigError) as refused:
        reshard_before_launch(cfg, 1)
    size = sum(path.stat().st_size for path in (directory / "global_step3").rglob("*") if path.is_file())
    assert str(refused.value) == (
        f"load: re-sharding {directory}/global_step3 ({size / 2**20:.1f} MiB) into this run's layout needs about as "
        f"much free space beside it, but {directory} has 1.0 MiB free: make room there, or resume on the layout it "
        "was saved with (TP 1 × PP 0 × DP 2), or re-shard it elsewhere with tools/grow_checkpoint.py")
    assert sorted(directory.rglob("*")) == written

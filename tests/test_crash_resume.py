"""Kill a training job the way clusters do, resume it, and get exactly the uninterrupted run.

One job is SIGKILLed at a random moment of a random iteration, the next one in
the middle of writing a checkpoint, the next gets the preemption signal on one
rank only (all ranks save at the next iteration boundary and exit 0), and the
last runs to the end. Every loss any of them logged and the final weights must
equal an uninterrupted run's bitwise (fp32 on CPU), with dropout on, for DP=2
with ZeRO-1, TP=2 with ZeRO-2 and PP=2 with ZeRO-1. The kill points come from a
random seed shown in failure messages.
"""

from __future__ import annotations

import os
import random
import re
import signal
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.checkpoint.selection import checkpoint_problems
from tests.conftest import read_metrics
from tests.distributed import run_on_ranks
from tests.killable_job import start_job, wait_until
from tests.test_tensor_parallel_training import train

pytestmark = pytest.mark.slow

ITERATIONS = 9
# extra overrides, and the signal the scheduler sends (SIGUSR1 has to be named in exit_signals)
LAYOUTS = {
    "dp2_zero1": ([], signal.SIGTERM),
    "tp2_zero2": (["model_parallel_size=2", "zero_optimization={stage: 2}", "exit_signals=[SIGUSR1]"],
                  signal.SIGUSR1),
    "pp2_zero1": (["pipe_parallel_size=2"], signal.SIGTERM),
}


def overrides(demo_data: Path, run_dir: Path, layout: str) -> list[str]:
    return [f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json",
            f"train_iters={ITERATIONS}", f"lr_decay_iters={ITERATIONS}", "eval_iters=0", "eval_interval=1000",
            "train_micro_batch_size_per_gpu=2", "attention_dropout=0.1", "hidden_dropout=0.1",
            "checkpoint_factor=3", "keep_last_n_checkpoints=2", f"save={run_dir}/checkpoints",
            f"load={run_dir}/checkpoints", f"log_dir={run_dir}/logs", *LAYOUTS[layout][0]]


def train_noting_pid(run_dir: Path, overrides: list[str]) -> None:
    (run_dir / f"pid_{dist.get_rank()}").write_text(str(os.getpid()))
    train(overrides)


def logged_lines(run_dir: Path) -> int:
    metrics = run_dir / "logs" / "metrics.jsonl"
    return metrics.read_text().count("\n") if metrics.is_file() else 0


def printed_iterations(log: Path) -> int:
    return len(re.findall(r"^ *iteration +\d+/\d+ \|", log.read_text(), re.MULTILINE)) if log.is_file() else 0


def saving(checkpoints: Path, since: float) -> bool:
    """A checkpoint is being written: its temporary directory has files written after `since` (not ones an
    earlier kill left)."""
    try:
        return any(path.stat().st_mtime >= since for path in checkpoints.glob(".tmp-global_step*/*"))
    except FileNotFoundError:  # renamed or removed while we looked
        return False


def final_weights(checkpoints: Path) -> dict[str, torch.Tensor]:
    """'FILE:NAME' -> tensor, from the last checkpoint's model files (mp_rank_XX, and a pipeline's layer files)."""
    weights = {}
    for path in (checkpoints / f"global_step{ITERATIONS}").glob("*model_states.pt"):
        state = torch.load(path, weights_only=True)
        module = state["module"] if "module" in state else state
        weights.update({f"{path.name}:{name}": tensor for name, tensor in (module or {}).items()})
    return weights


@pytest.mark.parametrize("layout", LAYOUTS)
def test_killed_and_preempted_run_resumes_to_the_uninterrupted_losses(layout, demo_data, tmp_path):
    seed = random.randrange(2**32)
    rng, context = random.Random(seed), f"layout {layout}, seed {seed}"
    reference_dir = tmp_path / "reference"
    run_on_ranks(2, train, overrides(demo_data, reference_dir, layout))
    expected = {r["iteration"]: r["lm_loss"] for r in read_metrics(reference_dir / "logs")}
    # One iteration's time, from the reference run: the first kill lands within the next iteration
    iteration_seconds = statistics.median(r["ms_per_iter"] for r in read_metrics(reference_dir / "logs")
                                          if r["split"] == "train" and not r["includes_warmup"]) / 1000

    run_dir = tmp_path / "interrupted"
    run_dir.mkdir()
    checkpoints, log = run_dir / "checkpoints", run_dir / "job.log"

    def start():
        return start_job(2, train_noting_pid, run_dir, overrides(demo_data, run_dir, layout), log=log)

    job, kill_after = start(), rng.randint(1, 4)
    wait_until(lambda: logged_lines(run_dir) >= kill_after, job)
    time.sleep(rng.uniform(0, iteration_seconds))
    job.kill()

    started, job = time.time(), start()
    wait_until(lambda: saving(checkpoints, started), job, poll_seconds=0.0005)
    job.kill()
    assert saving(checkpoints, started), f"the kill came after the save completed ({context})"

    # the job's own iteration lines, not metrics.jsonl's: the resumed run first drops the records the killed
    # attempt logged after its checkpoint, so a count of those lines would let it reach its last iterations first
    printed_before, job = printed_iterations(log), start()
    wait_until(lambda: printed_iterations(log) > printed_before, job)
    preemption_signal = LAYOUTS[layout][1]
    os.kill(int((run_dir / f"pid_{rng.randrange(2)}").read_text()), preemption_signal)
    assert job.wait() == 0, log.read_text()
    output = log.read_text()
    assert re.search(r"\n  \.tmp-global_step\d+: an interrupted save", output), output
    stop = re.search(rf"exiting after iteration (\d+): {preemption_signal.name} received", output)
    assert stop, output
    assert (checkpoints / "latest").read_text() == f"global_step{stop.group(1)}"
    assert checkpoint_problems(checkpoints / f"global_step{stop.group(1)}") == []

    assert start().wait() == 0, log.read_text()
    records = [r for r in read_metrics(run_dir / "logs") if r["split"] == "train"]
    # each iteration once, the latest attempt's: a resumed run drops what earlier attempts logged after its checkpoint
    assert sorted(r["iteration"] for r in records) == list(range(1, ITERATIONS + 1)), context
    differing = [(r["iteration"], r["lm_loss"], expected[r["iteration"]]) for r in records
                 if r["lm_loss"] != expected[r["iteration"]]]
    assert not differing, (context, differing)
    resumed, uninterrupted = final_weights(checkpoints), final_weights(reference_dir / "checkpoints")
    assert resumed.keys() == uninterrupted.keys() and resumed
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in resumed), context

"""Restart tests' shared pieces (max_restarts, megatron/launch/restarts.py): the run, faults sent to its ranks at
given iterations, and what the restarted run must equal.

The run trains the tiny config 14 iterations on 2 ranks with a checkpoint every 5 (deterministic: true); the
faults are real signals sent by the test to a real rank once metrics.jsonl shows the iteration: a SIGKILL to local
rank 0 at iteration 7 (the run restarts from global_step5), a SIGSTOP to local rank 1 at iteration 12, which rank 0's
hang watch ends after hang_timeout (exit 124; the restart from global_step10).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from megatron.launch.restarts import RESTART_SPLIT
from megatron.launch.supervise import runs_script
from tests.test_training_e2e import data_overrides

ITERATIONS = 14
# (iteration after which the fault comes, the rank it hits, the signal, the checkpoint the restart resumes from)
FAULTS = ((7, 0, signal.SIGKILL, "global_step5"), (12, 1, signal.SIGSTOP, "global_step10"))
HANG_TIMEOUT = 6
FAULT_TIMEOUT_SECONDS = 180
# The environment of every launch: one thread per rank, so that runs compare bitwise whichever launcher started
# them (a rank takes its share of the cores from LOCAL_SIZE, which srun does not set: 2 threads each there).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def run_overrides(demo_data: Path, run_dir: Path) -> list[str]:
    return [*data_overrides(demo_data), f"train_iters={ITERATIONS}", f"lr_decay_iters={ITERATIONS}", "eval_iters=0",
            "eval_interval=1000", "checkpoint_factor=5", "deterministic=true", f"hang_timeout={HANG_TIMEOUT}",
            f"save={run_dir}/checkpoints",
            f"load={run_dir}/checkpoints", f"log_dir={run_dir}/logs"]


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's whole records (a line being written is left for the next look)."""
    path = run_dir / "logs" / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def training_ranks(process: psutil.Process) -> dict[int, psutil.Process]:
    """Local rank -> the train.py process under `process` (deepy.py) running it."""
    ranks = {}
    for child in process.children(recursive=True):
        try:
            command = child.cmdline()
        except psutil.Error:
            continue
        if runs_script(command, "train.py"):
            ranks.update({int(a.split("=")[1]): child for a in command if a.startswith("--local_rank=")})
    return ranks


def slurm_job_ranks(job: str) -> dict[int, psutil.Process]:
    """Local rank -> the train.py task of SLURM job `job` running it on this machine (started by slurmd)."""
    ranks = {}
    for process in psutil.process_iter():
        try:
            environment = process.environ()
            if environment.get("SLURM_JOB_ID") == job and runs_script(process.cmdline(), "train.py"):
                ranks[int(environment["SLURM_LOCALID"])] = process
        except (psutil.Error, KeyError):
            continue
    return ranks


def send_faults(running: Callable[[], bool], run_dir: Path, ranks: Callable[[], dict[int, psutil.Process]]) -> None:
    """Each of FAULTS in turn: once the attempt running has logged its iteration, its signal to that rank. The log is
    read every 10 ms (the fault must land before the next checkpoint); the ranks are looked up once it shows the
    iteration, and whether the job still runs is asked once a second (a process scan, an scontrol call)."""
    for done, (iteration, rank, fault, _) in enumerate(FAULTS):
        deadline = time.monotonic() + FAULT_TIMEOUT_SECONDS
        next_look = time.monotonic()
        while True:
            logged = records(run_dir)
            restarts = sum(r["split"] == RESTART_SPLIT for r in logged)
            reached = max((r["iteration"] for r in logged if r["split"] == "train"), default=0)
            target = ranks().get(rank) if restarts == done and reached >= iteration else None
            if target is not None:
                target.send_signal(fault)
                break
            if time.monotonic() >= next_look:
                assert running() and time.monotonic() < deadline, f"no iteration {iteration} after {done} restarts"
                next_look = time.monotonic() + 1
            time.sleep(0.01)


def final_weights(checkpoints: Path) -> dict[str, torch.Tensor]:
    """'NAME' -> tensor of the last checkpoint's model."""
    [path] = (checkpoints / f"global_step{ITERATIONS}").glob("mp_rank_*_model_states.pt")
    return torch.load(path, weights_only=True)["module"]


def assert_equals_the_uninterrupted_run(run_dir: Path, reference_dir: Path) -> None:
    """Every iteration logged once, the losses and the final weights bitwise those of the run without faults, and
    the two restarts recorded at the checkpoints they resumed from."""
    logged, expected = records(run_dir), records(reference_dir)
    train = [(r["iteration"], r["lm_loss"]) for r in logged if r["split"] == "train"]
    assert train == [(r["iteration"], r["lm_loss"]) for r in expected if r["split"] == "train"], train
    assert [r["iteration"] for r in logged if r["split"] == "train"] == list(range(1, ITERATIONS + 1))
    restarts = [r for r in logged if r["split"] == RESTART_SPLIT]
    assert [(r["restart"], r["checkpoint"], r["iteration"]) for r in restarts] == [
        (1, "global_step5", 5), (2, "global_step10", 10)], restarts
    resumed, uninterrupted = final_weights(run_dir / "checkpoints"), final_weights(reference_dir / "checkpoints")
    assert resumed.keys() == uninterrupted.keys() and resumed
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in resumed)

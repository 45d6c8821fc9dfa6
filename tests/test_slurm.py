"""launcher: slurm on a real single-node SLURM cluster (munged, slurmctld, slurmd on localhost).

sbatch jobs run tools/slurm/train.sbatch (hostfile from SLURM_JOB_NODELIST,
srun launch, 2 tasks) to a checkpoint and resume it in a second job; a job
array runs tools/slurm/preprocess.sbatch; a failing task ends its srun step;
tools/slurm/cluster_check.sbatch passes every section of the cluster check.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.conftest import REPO, read_metrics
from tests.distributed import free_port
from tests.launch_checks import TINY, assert_job_ended_promptly, assert_ranks_joined, run_rank_check
from tests.restart_faults import (FAULTS, ONE_THREAD, assert_equals_the_uninterrupted_run, run_overrides,
                                  send_faults, slurm_job_ranks)
from tests.slurm_cluster import SlurmCluster
from tests.system_packages import require_debian_packages
from tests.test_cluster_check import report_sections
from tests.test_training_e2e import data_overrides

pytestmark = [pytest.mark.system, pytest.mark.slow]

JOB_TIMEOUT_SECONDS = 600
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    require_debian_packages({"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-wlm", "munged": "munge"})
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def submit_env(slurm, tmp_path_factory) -> dict[str, str]:
    """The cluster's environment with `python` on PATH running this interpreter, as for a user with the venv active.

    Only `python` is added: the venv's other programs (its ninja differs from the system's) would make
    DeepSpeed rebuild its compiled ops for every test that runs without them.
    """
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    return dict(slurm.environment(), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def submit(env: dict[str, str], options: list[str], script: str, *args: str) -> str:
    """Submit from the repository root; the job's id."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", *options, script, *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def final_states(env: dict[str, str], job: str) -> list[str] | None:
    """The final states of `job`'s tasks (every task of an array), or None while one has not ended."""
    shown = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True)
    states = re.findall(r"JobState=(\S+)", shown.stdout)
    return states if states and FINAL_STATES.issuperset(states) else None


def sbatch(env: dict[str, str], options: list[str], script: str, *args: str) -> list[str]:
    """Submit from the repository root and wait for the job (every task of an array); returns their final states."""
    return wait_for_job(env, submit(env, options, script, *args))


def wait_for_job(env: dict[str, str], job: str) -> list[str]:
    """The final states of `job`'s tasks, once every one has ended.

    Polls twice a second: `sbatch --wait` backs off to tens of seconds between polls.
    """
    deadline = time.monotonic() + JOB_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        states = final_states(env, job)
        if states:
            return states
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not finish within {JOB_TIMEOUT_SECONDS} s")


def train_job(env: dict[str, str], run_dir: Path, demo_data: Path, name: str, *overrides: str, tasks: int = 2) -> str:
    """One tools/slurm/train.sbatch job with `tasks` tasks on the (GPU-less) node; returns its output."""
    output = run_dir / f"{name}.out"
    result = sbatch(
        env,
        ["--gpus-per-node=0", f"--ntasks-per-node={tasks}", f"--output={output}"],
        "tools/slurm/train.sbatch",
        TINY,
        *data_overrides(demo_data),
        f"master_port={free_port()}",
        f"save={run_dir}/checkpoints",
        f"log_dir={run_dir}/{name}_logs",
        *overrides,
    )
    text = output.read_text() if output.exists() else ""
    assert result == ["COMPLETED"], f"job {result}\n{text}"
    return text


def train_iterations(log_dir: Path) -> list[int]:
    return [r["iteration"] for r in read_metrics(log_dir) if r["split"] == "train"]


@pytest.fixture(scope="module")
def first_job(submit_env, demo_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("slurm_training")
    return run_dir, train_job(submit_env, run_dir, demo_data, "first", "train_iters=6")


def test_sbatch_job_trains_two_srun_tasks_to_a_checkpoint(first_job):
    run_dir, output = first_job
    assert "launching 2 processes: srun --ntasks=2 --nodes=1 --ntasks-per-node=2" in output
    assert train_iterations(run_dir / "first_logs") == list(range(1, 7))
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "global_step6"
    shards = list((checkpoints / "global_step6").glob("zero_pp_rank_*_optim_states.pt"))
    assert len(shards) == 2, shards  # one ZeRO-1 optimizer shard per task: both trained as one group


def test_second_job_resumes_from_the_first_jobs_checkpoint(first_job, submit_env, demo_data):
    run_dir, _ = first_job
    output = train_job(submit_env, run_dir, demo_data, "second", "train_iters=10", f"load={run_dir}/checkpoints")
    assert f"resumed from {run_dir}/checkpoints at iteration 6" in output
    assert train_iterations(run_dir / "second_logs") == list(range(7, 11))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "global_step10"


def test_the_same_job_on_a_smaller_allocation_resumes_the_checkpoint_re_sharded(first_job, submit_env, demo_data):
    """The template resubmitted with one task instead of two (this cluster has one node, so half its tasks stand
    for a lost node; num_gpus follows the tasks per node): deepy.py re-shards the 2-rank ZeRO checkpoint and keeps
    its global batch, and training continues."""
    run_dir, _ = first_job
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    iteration = int(latest.removeprefix("global_step"))
    output = train_job(submit_env, run_dir, demo_data, "smaller", f"train_iters={iteration + 2}",
                       f"load={run_dir}/checkpoints", "num_gpus=1", tasks=1)
    assert (f"resuming {latest} (TP 1 × PP 0 × DP 2) as TP 1 × PP 0 × DP 1: re-sharded into {latest}-tp1pp0dp1"
            in output), output
    assert "its global batch of" in output and f"resumed from {run_dir}/checkpoints at iteration {iteration}" in output
    assert train_iterations(run_dir / "smaller_logs") == [iteration + 1, iteration + 2]


def test_preprocess_job_array_tokenizes_one_input_per_task(submit_env, demo_data, tmp_path):
    documents = (demo_data / "corpus.jsonl").read_text().splitlines()[:40]
    shards = [documents[:15], documents[15:]]
    for index, shard in enumerate(shards):
        (tmp_path / f"part{index}.jsonl").write_text("\n".join(shard) + "\n")
    (tmp_path / "inputs.txt").write_text("".join(f"{tmp_path}/part{index}.jsonl\n" for index in range(len(shards))))
    result = sbatch(
        submit_env,
        ["--array=0-1", "--cpus-per-task=1", f"--output={tmp_path}/task-%a.out"],
        "tools/slurm/preprocess.sbatch",
        f"{tmp_path}/inputs.txt",
        f"{tmp_path}/out/corpus",
        "--tokenizer-type", "HFTokenizer", "--vocab-file", f"{demo_data}/tokenizer.json", "--append-eod",
    )
    logs = "\n".join(path.read_text() for path in sorted(tmp_path.glob("task-*.out")))
    assert result == ["COMPLETED", "COMPLETED"], f"array tasks {result}\n{logs}"
    for index, shard in enumerate(shards):
        assert len(MMapIndexedDataset(f"{tmp_path}/out/corpus_{index:05d}_text_document")) == len(shard)


def test_failing_task_ends_the_srun_step_within_seconds(slurm, demo_data, tmp_path, monkeypatch):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{socket.gethostname()} slots=2\n")
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv("FAIL_RANK", "1")
    result = run_rank_check(demo_data, "launcher=slurm", f"hostfile={hostfile}", check=False)
    assert_ranks_joined(result, world_size=2)
    assert f"master {socket.gethostname()}" in result.stdout  # the first node of SLURM_STEP_NODELIST
    assert_job_ended_promptly(result, failed_rank=1)


def test_cluster_check_job_passes_every_section_through_its_template(submit_env, demo_data, tmp_path):
    output = tmp_path / "check.out"
    result = sbatch(submit_env, ["--gpus-per-node=0", "--ntasks-per-node=2", f"--output={output}"],
                    "tools/slurm/cluster_check.sbatch", TINY, *data_overrides(demo_data), f"master_port={free_port()}",
                    "model_parallel_size=2", f"save={tmp_path}/save", f"log_dir={tmp_path}/logs")
    text = output.read_text() if output.exists() else ""
    assert result == ["COMPLETED"], f"job {result}\n{text}"
    assert "launching 2 processes: srun --ntasks=2 --nodes=1 --ntasks-per-node=2" in text
    assert "cluster check: PASS" in text and "Traceback" not in text
    assert set(report_sections(tmp_path / "logs").values()) == {"PASS"}


def test_a_job_with_max_restarts_restarts_every_task_in_its_allocation_and_equals_the_uninterrupted_run(
        submit_env, demo_data, restart_reference, tmp_path):
    """tools/slurm/train.sbatch with one key more, max_restarts=2: task 0 SIGKILLed at iteration 7, and task 1
    SIGSTOPped at iteration 12 (task 0's hang watch exits 124), end their srun step; deepy.py, in the same
    allocation, runs srun again from the latest checkpoint, and the job completes as the run without faults did
    (tests/restart_faults.py)."""
    output = tmp_path / "job.out"
    job = submit(dict(submit_env, **ONE_THREAD), ["--gpus-per-node=0", "--ntasks-per-node=2", f"--output={output}"],
                 "tools/slurm/train.sbatch", TINY, *run_overrides(demo_data, tmp_path), f"master_port={free_port()}",
                 "max_restarts=2")
    send_faults(lambda: final_states(submit_env, job) is None, tmp_path, lambda: slurm_job_ranks(job))
    result = wait_for_job(submit_env, job)
    text = output.read_text() if output.exists() else ""
    assert result == ["COMPLETED"], f"job {result}\n{text}"
    assert text.count("launching 2 processes: srun --ntasks=2") == 1, text
    for restart, ((_, _, _, checkpoint), how) in enumerate(zip(FAULTS, ("Killed", "Exited with exit code 124"),
                                                                strict=True), start=1):
        assert re.search(rf"deepy.py: restart {restart} of 2 \(max_restarts\): srun reported [^\n]*task 0 on "
                         rf"{socket.gethostname()}: {how}[^\n]*; every rank ended, and all start again from "
                         rf"{tmp_path}/checkpoints/{checkpoint} ", text), text
    assert_equals_the_uninterrupted_run(tmp_path, restart_reference)


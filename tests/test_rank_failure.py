"""A rank that raises (or is killed) ends the whole job within seconds, with its error shown and the rank that
ended first named, under deepy.py's starter of local ranks (megatron/launch/local_ranks.py).

The other ranks are still working (tests/scripts/rank_check.py): only the
launcher tearing the job down stops them. The job is launched from a hostfile
with chosen slots, so the same run checks that path of deepy.py. The failure
check runs under srun in test_slurm.py and under mpirun in test_mpi.py too.
"""

from __future__ import annotations

import pytest

from tests.launch_checks import assert_job_ended_promptly, assert_ranks_joined, run_rank_check

pytestmark = pytest.mark.slow


def test_failing_rank_ends_a_hostfile_launch_within_seconds(demo_data, tmp_path, monkeypatch):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=3\n")
    monkeypatch.setenv("FAIL_RANK", "1")
    result = run_rank_check(demo_data, f"hostfile={hostfile}", "include=localhost:0,2", check=False)
    assert "-m megatron.launch.local_ranks --devices 0,2 " in result.stdout
    assert "note: num_gpus has no effect here: include/exclude choose the slots" in result.stdout
    assert_ranks_joined(result, world_size=2)
    assert result.stdout.count("deterministic kernels False, cuBLAS workspace None") == 2  # the default
    assert_job_ended_promptly(result, failed_rank=1)
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("deepy.py: tests/scripts/rank_check.py failed (the launcher exited "), last_line
    assert last_line.endswith("local rank 1 was the first to end: exited with status 1; the errors of the other "
                              "ranks follow from it"), last_line


def test_a_killed_rank_is_named_as_the_cause(demo_data, monkeypatch):
    """deepy.py names the killed rank as the cause, not the first error printed (another rank's consequence)."""
    monkeypatch.setenv("KILL_RANK", "1")
    result = run_rank_check(demo_data, check=False)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.endswith("local rank 1 was the first to end: killed by SIGKILL; the errors of the other ranks "
                              "follow from it"), last_line

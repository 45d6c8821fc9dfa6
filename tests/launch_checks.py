"""Launch tests' shared pieces: run tests/scripts/rank_check.py through deepy.py and judge a failing rank."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from tests.conftest import REPO, run_deepy
from tests.distributed import free_port
from tests.test_training_e2e import data_overrides

TINY = str(REPO / "tests" / "tiny.yml")
RANK_CHECK = "tests/scripts/rank_check.py"

# From the failing rank's raise to the launcher's exit. The other ranks would go on for 10 minutes.
FAILURE_SECONDS = 30
# A whole rank_check launch (start-up included); a launcher that leaves ranks running fails here, not in 10 minutes.
LAUNCH_TIMEOUT_SECONDS = 240


def run_rank_check(demo_data: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    """deepy.py tests/scripts/rank_check.py with the tiny config (2 processes) on a free port."""
    return run_deepy(
        RANK_CHECK, TINY, *data_overrides(demo_data), f"master_port={free_port()}", *overrides,
        check=check, timeout=LAUNCH_TIMEOUT_SECONDS,
    )


def assert_ranks_joined(result: subprocess.CompletedProcess, world_size: int) -> None:
    for rank in range(world_size):
        assert f"rank {rank} of {world_size}:" in result.stdout, result.stdout + result.stderr


def assert_job_ended_promptly(result: subprocess.CompletedProcess, failed_rank: int) -> None:
    """Non-zero exit, the failing rank's error shown, and the whole job gone within FAILURE_SECONDS."""
    ended = time.time()
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    match = re.search(rf"RuntimeError: rank {failed_rank} fails on purpose at (\d+\.\d+)", output)
    assert match, output
    assert ended - float(match[1]) < FAILURE_SECONDS, f"the job outlived the failure by {ended - float(match[1]):.0f} s"

"""launcher: openmpi on this machine: Debian's Open MPI runs 2 ranks on CPU that find their rank through mpi4py."""

from __future__ import annotations

import pytest

from tests.conftest import read_metrics, run_deepy
from tests.distributed import free_port
from tests.launch_checks import TINY, assert_job_ended_promptly, assert_ranks_joined, run_rank_check
from tests.system_packages import require_debian_packages, require_python_packages
from tests.test_training_e2e import data_overrides

pytestmark = [pytest.mark.system, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def open_mpi():
    require_debian_packages({"mpirun": "openmpi-bin", "ompi_info": "openmpi-bin"})
    require_python_packages("mpi4py", "requirements/requirements-mpi.txt")


def test_mpirun_trains_the_tiny_config_on_two_ranks(demo_data, tmp_path):
    result = run_deepy(
        "train.py",
        TINY,
        *data_overrides(demo_data),
        "launcher=openmpi",
        f"master_port={free_port()}",
        "train_iters=4",
        f"save={tmp_path}/checkpoints",
        f"log_dir={tmp_path}/logs",
    )
    assert "launching 2 processes: mpirun -n 2 --host localhost:2" in result.stdout
    assert [r["iteration"] for r in read_metrics(tmp_path / "logs") if r["split"] == "train"] == [1, 2, 3, 4]
    shards = list((tmp_path / "checkpoints" / "global_step4").glob("zero_pp_rank_*_optim_states.pt"))
    assert len(shards) == 2, shards  # one ZeRO-1 optimizer shard per rank: both trained as one group


def test_failing_rank_ends_the_mpirun_job_within_seconds(demo_data, monkeypatch):
    monkeypatch.setenv("FAIL_RANK", "0")
    result = run_rank_check(demo_data, "launcher=openmpi", check=False)
    assert_ranks_joined(result, world_size=2)
    assert "local rank 1" in result.stdout
    assert_job_ended_promptly(result, failed_rank=0)

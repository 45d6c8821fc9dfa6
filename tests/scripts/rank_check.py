"""Per-rank script for the launch tests, started by deepy.py like train.py but with no model.

Joins the process group through the framework's own rank discovery, checks
that every rank arrived (an all-reduce of the ranks), and prints what it
found. With $FAIL_RANK set, that rank then raises while the others go on
working (a 10-minute sleep stands for a long step): only the launcher ending
the whole job stops them in time. $KILL_RANK: that rank is killed (SIGKILL)
instead, as by the kernel's out-of-memory killer. $CHILD_PID_FILE: each rank
starts a long child process (as a compiler DeepSpeed starts on its first start)
and writes its pid there, then waits. $WAIT_RANK: that rank waits 10 minutes
before it joins (a slow start), so that the others reach the rendezvous first.
"""

import os
import signal
import subprocess
import time

import torch
import torch.distributed as dist

from megatron.config import Config
from megatron.runtime.entry import run_rank
from megatron.runtime.process_group import initialize_distributed


def check(cfg: Config) -> None:
    wait_rank = os.environ.get("WAIT_RANK")  # RANK before the group exists: set by the local launcher, not srun
    if wait_rank is not None and wait_rank == os.environ["RANK"]:
        time.sleep(600)
    initialize_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = torch.tensor([rank])
    dist.all_reduce(ranks)
    assert ranks.item() == world * (world - 1) // 2, ranks.item()
    local_rank, master = os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"]
    print(f"rank {rank} of {world}: local rank {local_rank}, master {master}, deterministic kernels "
          f"{torch.are_deterministic_algorithms_enabled()}, cuBLAS workspace "
          f"{os.environ.get('CUBLAS_WORKSPACE_CONFIG')}", flush=True)
    if os.environ.get("FAIL_RANK") == str(rank):
        raise RuntimeError(f"rank {rank} fails on purpose at {time.time():.3f}")
    if os.environ.get("KILL_RANK") == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)
    if "CHILD_PID_FILE" in os.environ:
        child = subprocess.Popen(["sleep", "600"])
        with open(os.environ["CHILD_PID_FILE"], "a") as pids:
            pids.write(f"{child.pid}\n")
    if {"FAIL_RANK", "KILL_RANK", "CHILD_PID_FILE"} & set(os.environ):
        time.sleep(600)


if __name__ == "__main__":
    run_rank(check, __doc__)  # as train.py: the group left and the process ended as a training rank's are

"""Give torch.distributed its env:// variables on every rank, whichever launcher started it.

deepy.py's local starter, DeepSpeed's launcher and torchrun set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
and MASTER_PORT themselves. srun and mpirun do not: under `launcher: slurm`
they come from SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and the first node of
SLURM_STEP_NODELIST (where task 0 runs); under `launcher: openmpi|mpich` from
mpi4py, which works for any MPI. `master_addr`, when set, wins in both.
"""

from __future__ import annotations

import os
import subprocess

from megatron.config import Config, ConfigError
from megatron.config.schema import GPT_NEOX_PORT

TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _torch_variables(rank, world_size, local_rank, master_addr: str, master_port: int) -> dict[str, str]:
    return dict(zip(TORCH_VARIABLES, map(str, (rank, world_size, local_rank, master_addr, master_port))))


def _first_host(nodelist: str) -> str:
    """First host of a compressed SLURM host list such as 'gpu[01-04],cpu7'."""
    expanded = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    ).stdout.split()
    return expanded[0]


def _from_slurm(cfg: Config, port: int) -> dict[str, str]:
    try:
        rank, size, local = os.environ["SLURM_PROCID"], os.environ["SLURM_NTASKS"], os.environ["SLURM_LOCALID"]
        nodelist = os.environ["SLURM_STEP_NODELIST"]
    except KeyError as missing:
        raise ConfigError(
            f"launcher: slurm, but {missing} is not set, so srun did not start this process; "
            "launch with python deepy.py inside an allocation (sbatch tools/slurm/train.sbatch ...)"
        ) from None
    master = cfg.master_addr or _first_host(nodelist)
    return _torch_variables(rank, size, local, master, port)


def _from_mpi(cfg: Config, port: int) -> dict[str, str]:
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError(
            f"launcher: {cfg.launcher}: ranks read their rank through mpi4py, which is not installed; "
            "pip install -r requirements/requirements-mpi.txt"
        ) from None
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    master = cfg.master_addr or world.bcast(MPI.Get_processor_name(), root=0)
    values = _torch_variables(world.Get_rank(), world.Get_size(), node.Get_rank(), master, port)
    node.Free()
    # All ranks are here together, so finalizing is quick now; at exit it would wait for every rank,
    # and a rank that raised would hang instead of ending the job.
    MPI.Finalize()
    return values


def _slurm_tasks_on_this_node() -> int | None:
    """This node's task count from srun's SLURM_STEP_TASKS_PER_NODE ('2(x3),1': two tasks on each of three
    nodes, then one) at SLURM_NODEID, or None outside an srun step."""
    listed, node = os.environ.get("SLURM_STEP_TASKS_PER_NODE"), os.environ.get("SLURM_NODEID")
    if not listed or node is None:
        return None
    counts: list[int] = []
    for entry in listed.split(","):
        tasks, _, repeat = entry.partition("(x")
        counts += [int(tasks)] * int(repeat.rstrip(")") or 1)
    return counts[min(int(node), len(counts) - 1)]


def local_process_count() -> int:
    """How many ranks share this node: DeepSpeed's launcher and deepy.py's set LOCAL_SIZE, torchrun
    LOCAL_WORLD_SIZE, srun SLURM_STEP_TASKS_PER_NODE, Open MPI OMPI_COMM_WORLD_LOCAL_SIZE and MPICH
    MPI_LOCALNRANKS; 1 when none is set."""
    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    slurm = _slurm_tasks_on_this_node()
    if slurm:
        return slurm
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def export_rank_environment(cfg: Config) -> None:
    """Set the env:// variables for this rank, or raise ConfigError saying how to launch it. master_port is
    GPT-NeoX's where nothing chose one (a config not resolved by deepy.py)."""
    port = cfg.master_port if cfg.master_port is not None else GPT_NEOX_PORT
    if cfg.launcher == "slurm":
        os.environ.update(_from_slurm(cfg, port))
    elif cfg.launcher in ("openmpi", "mpich"):
        os.environ.update(_from_mpi(cfg, port))
    missing = [name for name in TORCH_VARIABLES if name not in os.environ]
    if missing:
        raise ConfigError(
            f"this process has no {', '.join(missing)}: start it with python deepy.py (or torchrun); "
            "processes started by srun or mpirun need launcher: slurm, openmpi or mpich"
        )

"""launcher: openmpi / mpich: deepy.py runs `mpirun` with one process per slot; each learns its rank through mpi4py.

Both MPIs end the whole job when one process exits non-zero, so a failing
rank never leaves the others waiting in a collective.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

from megatron.config import Config, ConfigError
from megatron.launch.resources import Slots, require_leading_slots, uniform_slots_per_host, world_size

# Open MPI passes the environment only to local processes; these are exported to remote ones too.
_FORWARDED = ("PATH", "LD_LIBRARY_PATH", "PYTHON", "NCCL_", "CUDA_", "UCX_", "TOKENFORMER_", "WANDB_", "HF_")


def _require(program: str, package: str, launcher: str) -> None:
    if not shutil.which(program):
        raise ConfigError(f"launcher: {launcher} needs {program} on PATH; install {package}")
    if importlib.util.find_spec("mpi4py") is None:
        raise ConfigError(
            f"launcher: {launcher}: every rank reads its rank through mpi4py, which is not installed; "
            "pip install -r requirements/requirements-mpi.txt"
        )


def check_openmpi(cfg: Config, slots: Slots) -> None:
    require_leading_slots(slots, "openmpi")
    _require("ompi_info", "Open MPI (apt-get install openmpi-bin)", "openmpi")


def check_mpich(cfg: Config, slots: Slots) -> None:
    uniform_slots_per_host(slots, "mpich")
    _require("mpichversion", "MPICH (apt-get install mpich)", "mpich")


def openmpi_command(cfg: Config, slots: Slots, script: str, script_args: list[str]) -> list[str]:
    hosts = ",".join(f"{host}:{len(ids)}" for host, ids in slots.items())
    # --bind-to none: Open MPI would pin each process to one core, starving PyTorch's threads.
    mpirun = ["mpirun", "-n", str(world_size(slots)), "--host", hosts, "--bind-to", "none"]
    if os.geteuid() == 0:
        mpirun.append("--allow-run-as-root")
    for name in sorted(os.environ):
        if name.startswith(_FORWARDED):
            mpirun += ["-x", name]
    return mpirun + [sys.executable, "-u", script, *script_args]


def mpich_command(cfg: Config, slots: Slots, script: str, script_args: list[str]) -> list[str]:
    per_host = uniform_slots_per_host(slots, "mpich")
    mpirun = ["mpirun", "-n", str(world_size(slots)), "-ppn", str(per_host), "-hosts", ",".join(slots)]
    return mpirun + [sys.executable, "-u", script, *script_args]

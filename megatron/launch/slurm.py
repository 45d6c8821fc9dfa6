"""launcher: slurm: deepy.py runs `srun` itself, one task per slot; each task reads its rank from SLURM's variables.

`--kill-on-bad-exit=1` makes a task that fails end the whole step at once,
instead of leaving the others blocked in a collective until a timeout.
"""

from __future__ import annotations

import shutil
import sys

from megatron.config import Config, ConfigError
from megatron.launch.resources import Slots, uniform_slots_per_host, world_size


def check(cfg: Config, slots: Slots) -> None:
    if not cfg.hostfile:
        raise ConfigError(
            "launcher: slurm needs hostfile: the allocation's nodes, 'HOST slots=TASKS_PER_NODE' per line; "
            "tools/slurm/train.sbatch writes it from SLURM_JOB_NODELIST"
        )
    uniform_slots_per_host(slots, "slurm")
    if not shutil.which("srun"):
        raise ConfigError(
            "launcher: slurm needs srun on PATH; run deepy.py on a SLURM node (sbatch tools/slurm/train.sbatch)"
        )


def command(cfg: Config, slots: Slots, script: str, script_args: list[str]) -> list[str]:
    srun = [
        "srun",
        f"--ntasks={world_size(slots)}",
        f"--nodes={len(slots)}",
        f"--ntasks-per-node={uniform_slots_per_host(slots, 'slurm')}",
        f"--nodelist={','.join(slots)}",
        "--kill-on-bad-exit=1",
    ]
    if cfg.comment:
        srun.append(f"--comment={cfg.comment}")
    return srun + [sys.executable, "-u", script, *script_args]

"""Check that the configured launcher can start these slots, and build its command.

Each launcher module offers `check(cfg, slots)`, run before any process
starts, and `command(cfg, slots, script, script_args)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron.config import Config, ConfigError
from megatron.launch import deepspeed_runner, mpi, slurm
from megatron.launch.resources import Slots
from megatron.launch.restarts import restarts_apply


@dataclass(frozen=True)
class Launcher:
    """The two things deepy.py needs from a launcher: its pre-launch check and its command."""

    check: Callable[..., None]
    command: Callable[..., list[str]]


LAUNCHERS = {
    "pdsh": Launcher(deepspeed_runner.check, deepspeed_runner.command),
    "slurm": Launcher(slurm.check, slurm.command),
    "openmpi": Launcher(mpi.check_openmpi, mpi.openmpi_command),
    "mpich": Launcher(mpi.check_mpich, mpi.mpich_command),
}


def check_launcher(cfg: Config, slots: Slots) -> None:
    if cfg.deepspeed_slurm and cfg.launcher != "slurm":
        raise ConfigError(
            f"deepspeed_slurm: true reads ranks from srun's environment, but launcher is {cfg.launcher!r}; "
            "set launcher: slurm as well (or drop deepspeed_slurm)"
        )
    LAUNCHERS[cfg.launcher].check(cfg, slots)


def launch_command(cfg: Config, slots: Slots, script: str, script_args: list[str]) -> list[str]:
    return LAUNCHERS[cfg.launcher].command(cfg, slots, script, script_args)


def launch_notes(cfg: Config) -> list[tuple[str, str]]:
    """(key, reason) for launcher keys that this launch ignores, for deepy.py to print."""
    notes = []
    if cfg.comment and cfg.launcher != "slurm":
        notes.append(("comment", f"only srun takes --comment; launcher {cfg.launcher} ignores it"))
    if cfg.num_gpus and (cfg.include or cfg.exclude):
        notes.append(("num_gpus", "include/exclude choose the slots of each host"))
    if cfg.max_restarts and not restarts_apply(cfg, cfg.user_script or ""):
        notes.append(("max_restarts", "only a training run restarts; an inference run, an eval_only run or a "
                      "cluster check ends at its first failure"))
    return notes

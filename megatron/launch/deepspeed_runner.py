"""launcher: pdsh (the default): DeepSpeed's runner starts the ranks, on this machine or through pdsh on each host.

deepy.py has already resolved the slots and checked ssh, so the runner gets
the exact slot list (`--include`) instead of re-deriving it from num_nodes/num_gpus.
"""

from __future__ import annotations

import shutil
import sys

from megatron.config import Config, ConfigError
from megatron.launch.hosts import is_local_host
from megatron.launch.ports import master_port
from megatron.launch.resources import Slots, world_size


def _remote_hosts(slots: Slots) -> list[str]:
    return [host for host in slots if not is_local_host(host)]


def check(cfg: Config, slots: Slots) -> None:
    remote = _remote_hosts(slots)
    if remote and not shutil.which("pdsh"):
        raise ConfigError(
            f"launcher pdsh starts processes on {', '.join(remote)} through pdsh, which is not installed; "
            "install it (apt-get install pdsh) or set launcher: slurm or openmpi"
        )


def _selection(cfg, slots: Slots) -> list[str]:
    """`--num_gpus N` when N local processes are all there is; otherwise the exact slots."""
    if not cfg.hostfile and list(slots.values()) == [list(range(world_size(slots)))]:
        return ["--num_gpus", str(world_size(slots))]
    return ["--include", "@".join(f"{host}:{','.join(map(str, ids))}" for host, ids in slots.items())]


def command(cfg: Config, slots: Slots, script: str, script_args: list[str]) -> list[str]:
    runner = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--log_level", "warning"]
    runner += ["--master_port", str(master_port(cfg))]
    runner += _selection(cfg, slots)
    if cfg.hostfile:
        remote = _remote_hosts(slots)
        master = cfg.master_addr or (next(iter(slots)) if remote else "127.0.0.1")
        runner += ["--hostfile", cfg.hostfile, "--launcher", "pdsh", "--no_ssh_check", "--master_addr", master]
        if remote:
            runner.append("--force_multi")
    return runner + [script, *script_args]

"""launcher: pdsh (the default): the ranks of this machine alone, or through pdsh on each host.

When every slot is on this machine, deepy.py's own starter (local_ranks.py) starts the ranks, as DeepSpeed's
runner and launcher.launch would, without their two Python processes importing torch and DeepSpeed first.
Otherwise DeepSpeed's runner starts them through pdsh; deepy.py has already resolved the slots and checked ssh,
so the runner gets the exact slot list (`--include`) instead of re-deriving it from num_nodes/num_gpus.
"""

from __future__ import annotations

import os
import shutil
import sys

from megatron.config import Config, ConfigError
from megatron.launch.hosts import is_local_host
from megatron.launch.ports import master_port
from megatron.launch.resources import Slots, local_device_ids


def _remote_hosts(slots: Slots) -> list[str]:
    return [host for host in slots if not is_local_host(host)]


def _local_devices(slots: Slots) -> tuple[str, list[str]]:
    """The accelerator's visible-devices variable and the devices the slots of a one-machine run name."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    variable = accelerator.visible_devices_envs()[0]
    [ids] = slots.values()
    return variable, local_device_ids(ids, accelerator.device_name(), variable, os.environ)


def check(cfg: Config, slots: Slots) -> None:
    remote = _remote_hosts(slots)
    if len(slots) == 1 and not remote:
        _local_devices(slots)  # a refusal before anything starts
    if remote and not shutil.which("pdsh"):
        raise ConfigError(
            f"launcher pdsh starts processes on {', '.join(remote)} through pdsh, which is not installed; "
            "install it (apt-get install pdsh) or set launcher: slurm or openmpi"
        )


def command(cfg: Config, slots: Slots, script: str, script_args: list[str]) -> list[str]:
    remote = _remote_hosts(slots)
    if len(slots) == 1 and not remote:
        return _local_command(cfg, slots, script, script_args)
    runner = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--log_level", "warning"]
    runner += ["--master_port", str(master_port(cfg))]
    runner += ["--include", "@".join(f"{host}:{','.join(map(str, ids))}" for host, ids in slots.items())]
    master = cfg.master_addr or (next(iter(slots)) if remote else "127.0.0.1")
    runner += ["--hostfile", cfg.hostfile, "--launcher", "pdsh", "--no_ssh_check", "--master_addr", master]
    if remote:
        runner.append("--force_multi")
    return runner + [script, *script_args]


def _local_command(cfg: Config, slots: Slots, script: str, script_args: list[str]) -> list[str]:
    variable, devices = _local_devices(slots)
    return [sys.executable, "-u", "-m", "megatron.launch.local_ranks", "--devices", ",".join(devices),
            "--master_addr", cfg.master_addr or "127.0.0.1", "--master_port", str(master_port(cfg)),
            "--visible_devices_variable", variable, script, *script_args]

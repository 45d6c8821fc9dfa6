"""Resolve which processes a run gets, and the DeepSpeed launcher command that starts them.

The world size must be known before the config is validated (batch sizes
depend on the data-parallel size), so the hostfile is read here with the same
include/exclude semantics as DeepSpeed's runner, which then starts the ranks.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from megatron.config import ConfigError

_HOST_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)\s*$")


def read_hostfile(path: str) -> dict[str, int]:
    """Parse MPI-style `host slots=N` lines (blank lines and # comments allowed)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"hostfile: {path!r} does not exist")
    hosts: dict[str, int] = {}
    for number, raw in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.match(line)
        if not match:
            raise ConfigError(f"hostfile {path}:{number}: {raw!r} is not 'HOST slots=N'")
        host, slots = match["host"], int(match["slots"])
        if host in hosts:
            raise ConfigError(f"hostfile {path}:{number}: host {host!r} is listed twice")
        if slots < 1:
            raise ConfigError(f"hostfile {path}:{number}: slots must be at least 1")
        hosts[host] = slots
    if not hosts:
        raise ConfigError(f"hostfile {path!r} lists no hosts")
    return hosts


def _local_slots(cfg) -> dict[str, int]:
    if cfg.num_gpus is not None:
        return {"localhost": cfg.num_gpus}
    from deepspeed.accelerator import get_accelerator

    return {"localhost": get_accelerator().device_count()}


def hostfile_slots(cfg) -> dict[str, int]:
    """Processes per host for this run: the hostfile (filtered) or the local machine."""
    if not cfg.hostfile:
        return _local_slots(cfg)
    pool = read_hostfile(cfg.hostfile)
    from deepspeed.launcher.runner import parse_inclusion_exclusion

    try:
        active = parse_inclusion_exclusion(pool, cfg.include or "", cfg.exclude or "")
    except ValueError as error:
        raise ConfigError(f"include={cfg.include!r} exclude={cfg.exclude!r}: {error}") from None
    hosts = list(active.items())
    if cfg.num_nodes > 0:
        if cfg.num_nodes > len(hosts):
            raise ConfigError(f"num_nodes={cfg.num_nodes} but the hostfile offers {len(hosts)} hosts")
        hosts = hosts[: cfg.num_nodes]
    return {host: min(len(ids), cfg.num_gpus or len(ids)) for host, ids in hosts}


def launcher_command(cfg, slots: dict[str, int], script: str, script_args: list[str]) -> list[str]:
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--log_level", "warning"]
    command += ["--master_port", str(cfg.master_port)]
    if cfg.master_addr:
        command += ["--master_addr", cfg.master_addr]
    if cfg.hostfile:
        command += ["--hostfile", cfg.hostfile, "--launcher", cfg.launcher]
        if cfg.include:
            command += ["--include", cfg.include]
        if cfg.exclude:
            command += ["--exclude", cfg.exclude]
        if cfg.num_nodes > 0:
            command += ["--num_nodes", str(cfg.num_nodes)]
        if cfg.no_ssh_check:
            command.append("--no_ssh_check")
    command += ["--num_gpus", str(max(slots.values()))]
    return command + [script, *script_args]

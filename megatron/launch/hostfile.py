"""Read an MPI-style hostfile: one `HOST slots=N` line per node, the pool a multi-node run draws from."""

from __future__ import annotations

import re
from pathlib import Path

from megatron.config import ConfigError

_HOST_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)$")
_FORMAT = "one 'HOST slots=N' line per node ('#' starts a comment)"


def read_hostfile(path: str) -> dict[str, int]:
    """Slots per host, in file order (rank order); every problem names the file and line."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"hostfile {path} does not exist; write {_FORMAT}, or remove the hostfile key to run on this machine"
        )
    hosts: dict[str, int] = {}
    for number, raw in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.match(line)
        if not match:
            raise ConfigError(f"hostfile {path}:{number}: {raw.strip()!r} is not 'HOST slots=N'; expected {_FORMAT}")
        host, slots = match["host"], int(match["slots"])
        if host in hosts:
            raise ConfigError(f"hostfile {path}:{number}: host {host!r} is listed twice; keep one line per host")
        if slots < 1:
            raise ConfigError(f"hostfile {path}:{number}: {host} has slots={slots}; give it at least 1 or remove it")
        hosts[host] = slots
    if not hosts:
        raise ConfigError(f"hostfile {path} lists no hosts; expected {_FORMAT}")
    return hosts

"""DeepSpeed's shared-memory buffers of CPU collectives: removed when a rank ends, and left-overs before a launch.

On a CPU, DeepSpeed's torch backend gives each rank of a world whose ranks all run on one machine a buffer of
about 64 MiB in /dev/shm, `deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`
(deepspeed/ops/csrc/cpu/comm/shm.cpp), and never unlinks it. /dev/shm is memory: every CPU run would keep
64 MiB per rank until the machine restarts (a day of test runs filled 20 GB here), and a later run on the same
port would map a dead run's buffers, whose state flags it did not write. So each rank removes its own buffer
after the final barrier (every peer has mapped it by then; the memory goes with the last mapping), and deepy.py
removes what a killed run left on its port, before launching (the port was found free: no live run owns them)
and after its ranks end.
"""

from __future__ import annotations

import os
from pathlib import Path

SHM_DIRECTORY = Path("/dev/shm")
PREFIX = "deepspeed_allreduce_buffer"


def remove_rank_buffer(rank: int) -> None:
    """This rank's buffer, named from the MASTER_ADDR and MASTER_PORT DeepSpeed read; nothing if it has none."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if address and port:
        (SHM_DIRECTORY / f"{PREFIX}_{os.getuid()}_{address}_{port}_{rank}").unlink(missing_ok=True)


def remove_port_buffers(master_port: int) -> int:
    """Every buffer of this user's runs on `master_port` (any address); how many. Only for a port no live run
    on this machine uses."""
    removed = 0
    for path in SHM_DIRECTORY.glob(f"{PREFIX}_{os.getuid()}_*_{master_port}_*"):
        if path.name.rsplit("_", 1)[-1].isdigit() and path.name.rsplit("_", 2)[-2] == str(master_port):
            path.unlink(missing_ok=True)
            removed += 1
    return removed

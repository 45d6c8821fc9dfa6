"""DeepSpeed's shared-memory buffers of CPU collectives: removed when a rank ends, and left-overs before a launch.

On a CPU, DeepSpeed's torch backend gives each rank of a world whose ranks all run on one machine a buffer of
about 64 MiB in /dev/shm, `deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`
(deepspeed/ops/csrc/cpu/comm/shm.cpp), and never unlinks it. /dev/shm is memory: every CPU run would keep its
buffers until the machine restarts, and a later run on the same port would map a dead run's buffers, whose
state flags it did not write. So each rank removes its own buffer
after the final barrier (every peer has mapped it by then; the memory goes with the last mapping), and deepy.py
removes what killed runs left on its port, before launching and after its ranks end: only buffers no live
process maps, so that another run on the same port (started by hand on a shared node) keeps its own.
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


def mapped_files() -> set[str]:
    """The files this user's live processes have mapped (from /proc/PID/maps; others' are unreadable, and the
    buffers' names carry their owner's uid)."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:
            continue  # ended meanwhile, or another user's
        mapped.update(line.split(maxsplit=5)[5] for line in lines if line.count(" ") >= 5 and "/" in line)
    return mapped


def remove_port_buffers(master_port: int) -> int:
    """Every buffer of this user's runs on `master_port` (any address) that no live process maps; how many."""
    candidates = [path for path in SHM_DIRECTORY.glob(f"{PREFIX}_{os.getuid()}_*_{master_port}_*")
                  if path.name.rsplit("_", 1)[-1].isdigit() and path.name.rsplit("_", 2)[-2] == str(master_port)]
    if not candidates:
        return 0
    in_use = mapped_files()
    removed = 0
    for path in candidates:
        if str(path) not in in_use:
            path.unlink(missing_ok=True)
            removed += 1
    return removed

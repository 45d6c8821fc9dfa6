"""Whether a rank ended by SIGKILL was likely ended by the kernel's out-of-memory killer.

That SIGKILL leaves no message of the rank's own, so deepy.py reads the kernel's counts of such kills before the
launch and after: those of its memory cgroup (the ranks are in it or below it), else the machine's
(/proc/vmstat). A count that rose names the likely cause, with the figures.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
MACHINE = "/proc/vmstat"
# A cgroup v1 memory limit at least this large is no limit (the kernel's "unlimited" is about 2**63).
UNLIMITED_BYTES = 2**62


def _counter(path: Path, name: str) -> int | None:
    """The value of the line `NAME N` of a kernel statistics file; None if unreadable or absent."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and fields[0] == name:
            return int(fields[1])
    return None


def memory_cgroup() -> tuple[Path, int] | None:
    """This process's memory cgroup folder and its hierarchy's version (1 or 2); None without one."""
    try:
        mount_lines = (PROC / "self" / "mounts").read_text().splitlines()
        cgroup_lines = (PROC / "self" / "cgroup").read_text().splitlines()
    except OSError:  # not Linux
        return None
    mounts = {}
    for line in mount_lines:
        _, mount_point, kind, options, *_ = line.split()
        if kind == "cgroup2":
            mounts[2] = Path(mount_point)
        elif kind == "cgroup" and "memory" in options.split(","):
            mounts[1] = Path(mount_point)
    for line in cgroup_lines:
        _, controllers, path = line.split(":", 2)
        version = 2 if controllers == "" else 1
        if (version == 1 and "memory" not in controllers.split(",")) or version not in mounts:
            continue
        folder = mounts[version] / path.lstrip("/")
        if (folder / ("memory.events" if version == 2 else "memory.oom_control")).is_file():
            return folder, version
    return None


def oom_kill_counts() -> dict[str, int]:
    """Where the kernel counts out-of-memory kills of this process's descendants -> the count so far.

    cgroup v2 counts a cgroup's kills with its descendants'; v1 each cgroup's alone, so every cgroup below
    this one is read."""
    cgroup = memory_cgroup()
    counts = {}
    if cgroup is not None and cgroup[1] == 2:
        count = _counter(cgroup[0] / "memory.events", "oom_kill")
        if count is not None:
            counts[str(cgroup[0])] = count
    elif cgroup is not None:
        for folder, _, _ in os.walk(cgroup[0]):
            count = _counter(Path(folder) / "memory.oom_control", "oom_kill")
            if count is not None:
                counts[folder] = count
    if not counts:
        count = _counter(Path(MACHINE), "oom_kill")
        if count is not None:
            counts[MACHINE] = count
    return counts


def _limit(folder: str) -> str:
    """', its memory limit 64 MiB' for a cgroup with a limit (v2 memory.max, v1 memory.limit_in_bytes); else ''."""
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            text = (Path(folder) / name).read_text().strip()
        except OSError:
            continue
        if text == "max" or int(text) >= UNLIMITED_BYTES:
            return ""
        return f", its memory limit {int(text) / 2**20:,.0f} MiB"
    return ""


def out_of_memory_kills(before: dict[str, int], after: dict[str, int]) -> str | None:
    """'likely by the kernel's out-of-memory killer: ...' when a count rose from `before` to `after`; else None.
    A cgroup made during the run counts from 0; the machine's count only against one read before."""
    places = []
    for where, count in after.items():
        if where == MACHINE and where not in before:
            continue
        kills = count - before.get(where, 0)
        if kills > 0 and where == MACHINE:
            places.append(f"{kills} on this machine ({MACHINE} oom_kill)")
        elif kills > 0:
            places.append(f"{kills} in memory cgroup {where}{_limit(where)}")
    if not places:
        return None
    return (f"likely by the kernel's out-of-memory killer, which ended processes during the run "
            f"({'; '.join(places)}); give the ranks more memory or make them use less")

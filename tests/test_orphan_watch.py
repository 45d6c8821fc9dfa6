"""deepy.py's identity, which its ranks watch (megatron/host/orphan_watch.py): the same process stays itself
when the wall clock steps, and a process that ended, or another with its pid, is not it (issue 42, item 1)."""

from __future__ import annotations

import shutil
import socket
import subprocess
from itertools import count
from pathlib import Path

import psutil._pslinux

from megatron.host import orphan_watch
from megatron.host.orphan_watch import launcher_identity


def launcher_alive(identity: str) -> bool:
    """What a rank's watch decides of the deepy.py that put `identity` in its environment."""
    _, pid, started = identity.split(":")
    return orphan_watch._launcher_alive(int(pid), int(started))


def test_a_wall_clock_step_between_two_reads_leaves_deepy_alive(monkeypatch):
    """psutil re-reads the boot time (/proc/stat's btime, wall-clock seconds) at every call; a clock step (a VM
    resumed, chrony's makestep) moves it, and deepy.py's start time with it."""
    boot = count(1_700_000_000, 7)  # the boot time seen moves by 7 s between any two reads
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: float(next(boot)))
    identity = launcher_identity()
    assert launcher_alive(identity) and launcher_alive(identity)


def test_an_ended_process_and_another_start_under_its_pid_are_not_deepy(tmp_path):
    # A command name with spaces and parentheses: /proc/PID/stat's second field
    odd = tmp_path / "dee) py (x"
    shutil.copy(shutil.which("sleep"), odd)
    process = subprocess.Popen([str(odd), "30"])
    try:
        host, pid, started = launcher_identity_of(process.pid).split(":")
        assert host == socket.gethostname() and int(pid) == process.pid
        assert orphan_watch._launcher_alive(process.pid, int(started))
        assert not orphan_watch._launcher_alive(process.pid, int(started) + 1)  # a reused pid
    finally:
        process.kill()
        process.wait()
    assert not orphan_watch._launcher_alive(process.pid, int(started))


def launcher_identity_of(pid: int) -> str:
    """launcher_identity() as the process `pid` would compute it for itself."""
    return f"{socket.gethostname()}:{pid}:{orphan_watch.start_ticks(pid)}"


def test_the_start_time_is_clock_ticks_since_boot():
    ticks = orphan_watch.start_ticks(psutil.Process().pid)
    fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
    assert ticks == int(fields[19])  # field 22 of proc(5), the 20th after the command name

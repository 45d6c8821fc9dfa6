"""deepy.py's identity, which its ranks watch (megatron/host/orphan_watch.py): the same process stays itself
when the wall clock steps, and a process that ended (a zombie too), another with its pid, or one this user may
not read (hidepid) is not it, and the watch then stops the rank."""

from __future__ import annotations

import builtins
import io
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from itertools import count
from pathlib import Path

import psutil
import psutil._pslinux

from megatron.host import orphan_watch
from megatron.host.orphan_watch import launcher_identity
from tests.conftest import REPO


def launcher_alive(identity: str) -> bool:
    """What a rank's watch decides of the deepy.py that put `identity` in its environment."""
    _, pid, started = identity.split(":")
    return orphan_watch._launcher_alive(int(pid), int(started))


def test_a_wall_clock_step_between_two_reads_leaves_deepy_alive(monkeypatch):
    """Every wall-clock reading Python offers moves by 7 s between any two reads, as after a clock step (a VM
    resumed, chrony's makestep): time.time(), the boot time in /proc/stat (which the kernel derives from the wall
    clock) and psutil's reading of it. A start time taken from any of them (psutil's create_time() adds the boot
    time) makes the live deepy.py look gone; the kernel's ticks since boot do not move."""
    steps = count(0, 7)
    real_time, real_time_ns, real_open = time.time, time.time_ns, builtins.open

    def stepped_open(file, mode="r", *args, **kwargs):
        if str(file) != "/proc/stat":
            return real_open(file, mode, *args, **kwargs)
        with real_open(file, "rb") as stream:
            lines = [b"btime %d\n" % (int(line.split()[1]) + next(steps)) if line.startswith(b"btime") else line
                     for line in stream]
        data = b"".join(lines)
        return io.BytesIO(data) if "b" in mode else io.StringIO(data.decode())

    monkeypatch.setattr(time, "time", lambda: real_time() + next(steps))
    monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + next(steps) * 10**9)
    monkeypatch.setattr(builtins, "open", stepped_open)
    monkeypatch.setattr(io, "open", stepped_open)
    first_boot = psutil.boot_time()
    assert psutil.boot_time() != first_boot and time.time() - time.time() < -1  # the clock does step here
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


# deepy.py, as far as its rank's watch sees it: it names itself to a rank it starts, says the rank's pid, and ends.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys
    from megatron.host.orphan_watch import VARIABLE, launcher_identity
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=open(sys.argv[2], "w"),
                            stderr=subprocess.STDOUT, env=dict(os.environ, **{VARIABLE: launcher_identity()}))
    print(rank.pid, flush=True)
    sys.stdin.readline()
""")
# A rank: the watch on deepy.py, and a stop as training/preemption.py's (here: say so and exit).
RANK = textwrap.dedent("""
    import signal, sys, time
    from megatron.host.orphan_watch import watch_launcher
    signal.signal(signal.SIGTERM, lambda *_: (print("stopped", flush=True), sys.exit(0)))
    watch_launcher()
    print("watching", flush=True)
    time.sleep(60)
""")


def test_a_rank_stops_when_deepy_has_ended_though_not_yet_reaped(tmp_path):
    """A zombie deepy.py (ended; its parent, a shell or a job script, not waiting for it yet) is gone to the watch,
    though /proc/PID/stat is there, with its start time, until the parent reaps it."""
    said = tmp_path / "rank.out"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, str(said)], cwd=REPO, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    rank = psutil.Process(int(launcher.stdout.readline()))
    try:
        deadline = time.monotonic() + 60
        while "watching" not in said.read_text():
            assert time.monotonic() < deadline and rank.is_running(), said.read_text()
            time.sleep(0.05)
        launcher.stdin.close()  # it ends; this test, its parent, does not reap it
        while psutil.Process(launcher.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
        _, alive = psutil.wait_procs([rank], timeout=15)  # not this test's child: its status is init's
        assert not alive and said.read_text().endswith(
            f"deepy.py (pid {launcher.pid}) is gone: this rank stops (a checkpoint at the next iteration if it "
            "trains)\nstopped\n"), said.read_text()
    finally:
        if rank.is_running():
            rank.kill()
        launcher.wait()


def test_a_pid_whose_process_this_user_may_not_read_ends_the_watch_by_stopping_the_rank(monkeypatch):
    """With /proc mounted hidepid=1 another user's /proc/PID/stat cannot be read (PermissionError): deepy.py,
    which runs as its ranks' user, is gone and its pid taken. The watch stops the rank rather than die of the
    error without a word and leave the rank training unattached."""
    pid, started = psutil.Process().pid, orphan_watch.start_ticks(psutil.Process().pid)
    real_read_bytes = Path.read_bytes

    def hidden(path: Path) -> bytes:
        if str(path) == f"/proc/{pid}/stat":
            raise PermissionError(13, "Permission denied", str(path))
        return real_read_bytes(path)

    stopped = []
    monkeypatch.setattr(Path, "read_bytes", hidden)
    monkeypatch.setattr(orphan_watch, "_stop_this_rank", stopped.append, raising=False)
    orphan_watch._watch(pid, started)
    assert stopped == [pid]

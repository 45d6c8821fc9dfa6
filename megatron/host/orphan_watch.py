"""Ranks end when deepy.py dies, even by SIGKILL (which it cannot pass on).

deepy.py names itself to the ranks it starts on its own machine (host, pid and start time, so that a reused
pid is not mistaken for it). The start time is the kernel's, clock ticks since boot (/proc/PID/stat), which
nothing moves; psutil's create_time() adds the boot time, re-read in wall-clock seconds, so a clock step (a VM
resumed, chrony's makestep) would make a live deepy.py look gone. Each such rank watches for it and, once it is
gone, stops the way a scheduler's SIGTERM stops it: a checkpoint at the next iteration, then exit. A rank that
does not stop within the grace period (a collective whose peers are gone) is killed. Otherwise orphaned ranks
would train on, holding the save directory's lock and the port, until they finished. Gone means: no process
under its pid, another process there (another start time), a zombie (it has ended; its parent has not yet
reaped it), or a process this user may not read (with /proc mounted hidepid, another user's: deepy.py runs as
the ranks' user, so its pid was reused).

deepy.py reads the ranks' output (megatron/launch/supervise.py); once it is gone, a write there would raise
BrokenPipeError wherever the rank happens to print, so the rank's stdout and stderr then go to /dev/null instead.
"""

from __future__ import annotations

import io
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path

VARIABLE = "TOKENFORMER_LAUNCHER"
POLL_SECONDS = 1.0
GRACE_SECONDS = 600.0


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses): state
    first; ProcessLookupError if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid}") from None
    return stat.rpartition(b")")[2].split()


def start_ticks(pid: int) -> int:
    """When process `pid` started, in clock ticks since boot (proc(5): /proc/PID/stat, field 22);
    ProcessLookupError if there is no such process."""
    return int(_stat_fields(pid)[19])


def launcher_identity() -> str:
    """What deepy.py puts in VARIABLE for its ranks: host:pid:start ticks."""
    return f"{socket.gethostname()}:{os.getpid()}:{start_ticks(os.getpid())}"


def _launcher_alive(pid: int, started: int) -> bool:
    """Whether deepy.py, process `pid` started at `started`, still runs (module docstring: what gone means)."""
    try:
        fields = _stat_fields(pid)
    except (ProcessLookupError, PermissionError):
        return False
    return fields[0] not in (b"Z", b"X") and int(fields[19]) == started


def _reader_gone(fd: int) -> bool:
    """Whether `fd` is a pipe whose reading end is closed (deepy.py read the ranks' stderr)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _keep_output_writable() -> None:
    """Point stdout and stderr at /dev/null where their reader died with deepy.py: a write there would raise
    BrokenPipeError in the middle of the checkpoint this rank is about to save."""
    for fd in (1, 2):
        if _reader_gone(fd):
            with open(os.devnull, "wb") as null:
                os.dup2(null.fileno(), fd)


class _OutputThatOutlivesItsReader(io.RawIOBase):
    """A file descriptor that, once its pipe's reader is gone, is pointed at /dev/null instead of failing."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, data) -> int:
        try:
            return os.write(self._fd, data)
        except BrokenPipeError:
            with open(os.devnull, "wb") as null:
                os.dup2(null.fileno(), self._fd)
            return len(data)


def outlive_the_output_reader() -> None:
    """sys.stdout and sys.stderr that survive deepy.py's death (line-buffered, as the ranks' output is read)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(io.BufferedWriter(_OutputThatOutlivesItsReader(fd)), encoding=old.encoding,
                                  errors=old.errors, line_buffering=True, write_through=True)
        old.flush()
        setattr(sys, name, stream)


def _watch(pid: int, started: int) -> None:
    while _launcher_alive(pid, started):
        time.sleep(POLL_SECONDS)
    _stop_this_rank(pid)


def _stop_this_rank(pid: int) -> None:
    """Stop as a scheduler's SIGTERM stops a rank; killed if that takes longer than GRACE_SECONDS."""
    _keep_output_writable()
    print(f"deepy.py (pid {pid}) is gone: this rank stops (a checkpoint at the next iteration if it trains)",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)


def watch_launcher() -> bool:
    """Start watching the deepy.py that launched this rank, if it runs on this host; whether it does."""
    host, _, rest = os.environ.get(VARIABLE, "").partition(":")
    if host != socket.gethostname() or not rest:
        return False
    pid, _, started = rest.partition(":")
    try:
        _stat_fields(int(pid))
    except PermissionError:  # deepy.py runs as another user: whether its pid is reused cannot be told
        print(f"this rank cannot watch deepy.py (pid {pid}): /proc/{pid}/stat is another user's; if deepy.py is "
              "killed, stop its ranks yourself", file=sys.stderr, flush=True)
        return False
    except ProcessLookupError:
        pass  # gone already: the watch stops this rank at once
    outlive_the_output_reader()
    threading.Thread(target=_watch, args=(int(pid), int(started)), daemon=True, name="launcher-watch").start()
    return True

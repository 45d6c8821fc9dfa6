"""deepy.py's supervision of a launch (megatron/launch/supervise.py): every stop signal reaches the ranks in every
window, and a rank killed by the kernel's out-of-memory killer is named so, a plain SIGKILL not.

run_launcher runs in a process of its own, as in deepy.py, over local_ranks.py and two small rank scripts (no
torch): a launch in about a second. deepy.py's own launches are in test_launch_signals.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.launch.out_of_memory import memory_cgroup
from tests.conftest import REPO
from tests.distributed import free_port

# deepy.py's last step: run_launcher(COMMAND, SCRIPT), then, with $AFTER_THE_END set, that signal to itself.
SUPERVISOR = """
import os, signal, sys
from megatron.launch.supervise import run_launcher
code = run_launcher(sys.argv[1:], sys.argv[-1]).code
if "AFTER_THE_END" in os.environ:
    os.kill(os.getpid(), int(os.environ["AFTER_THE_END"]))
sys.exit(code)
"""
# Each rank writes OUT/<LOCAL_RANK>.ready, then waits; with $CATCH set, a rank that saves on SIGTERM (as a training
# rank does) writes OUT/<LOCAL_RANK>.saved and exits 0.
RANK = """
import os, signal, sys, time
out = os.path.join(os.environ["OUT"], os.environ["LOCAL_RANK"])
def save(number, frame):
    with open(out + ".saved", "w") as saved:
        saved.write(signal.Signals(number).name)
    sys.exit(0)
if "CATCH" in os.environ:
    signal.signal(signal.SIGTERM, save)
open(out + ".ready", "w").close()
time.sleep(300)
"""
# Rank 0 is killed by SIGKILL: by itself, or, with $OOM_CGROUP set, by the kernel, for using more memory than that
# cgroup allows.
KILLED_RANK = """
import os, signal, time
if os.environ["LOCAL_RANK"] == "0" and "OOM_CGROUP" in os.environ:
    with open(os.path.join(os.environ["OOM_CGROUP"], "cgroup.procs"), "w") as procs:
        procs.write(str(os.getpid()))
    hog = b"x" * (1 << 30)
elif os.environ["LOCAL_RANK"] == "0":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(300)
"""


def supervise(tmp_path: Path, body: str, supervisor: tuple[str, ...] = (SUPERVISOR,),
              **environment: str) -> subprocess.Popen:
    """`supervisor` (Python code, then its arguments before the launcher's command) over local_ranks.py running
    `body` on 2 ranks."""
    script = tmp_path / "rank.py"
    script.write_text(body)
    launcher = [sys.executable, "-u", "-m", "megatron.launch.local_ranks", "--devices", "0,1", "--master_port",
                str(free_port()), str(script)]
    return subprocess.Popen([sys.executable, "-c", *supervisor, *launcher], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OUT=str(tmp_path), **environment))


def wait_until_ready(process: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 60
    while not all((out / f"{rank}.ready").exists() for rank in (0, 1)):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.02)


@pytest.mark.parametrize("stop", [signal.SIGUSR1, signal.SIGHUP, signal.SIGUSR2], ids=lambda s: s.name)
def test_a_stop_signal_while_the_ranks_train_reaches_them_and_they_save(tmp_path, stop):
    supervisor = supervise(tmp_path, RANK, CATCH="1")
    wait_until_ready(supervisor, tmp_path)
    supervisor.send_signal(stop)
    _, errors = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 0, errors
    assert [(tmp_path / f"{rank}.saved").read_text() for rank in (0, 1)] == ["SIGTERM"] * 2
    assert f"deepy.py: {stop.name} received; SIGTERM sent to the 2 ranks here" in errors


def test_a_stop_signal_while_the_ranks_start_is_told_as_a_stop(tmp_path):
    """Ranks still starting (importing, compiling) catch no signal yet: deepy.py says it stopped as asked, 128+N."""
    supervisor = supervise(tmp_path, RANK)
    wait_until_ready(supervisor, tmp_path)
    supervisor.send_signal(signal.SIGUSR1)
    _, errors = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 128 + signal.SIGUSR1, errors
    assert errors.splitlines()[-1] == (f"deepy.py: {tmp_path / 'rank.py'} stopped at your request (SIGUSR1) while "
                                       "its ranks were starting, before they could save a checkpoint")


def test_a_stop_signal_after_the_ranks_ended_has_nothing_to_stop(tmp_path):
    supervisor = supervise(tmp_path, "", AFTER_THE_END=str(int(signal.SIGHUP)))
    _, errors = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 0, errors
    assert errors.splitlines()[-1] == "deepy.py: SIGHUP received after the ranks ended; nothing left to stop"


@pytest.fixture
def small_memory_cgroup():
    """A memory cgroup of 64 MiB below this process's, which needs root and a writable cgroup hierarchy."""
    cgroup = memory_cgroup()
    if cgroup is None:
        pytest.skip("no memory cgroup here")
    folder, version = cgroup
    child = folder / f"oom-test-{os.getpid()}"
    try:
        child.mkdir()
        (child / ("memory.max" if version == 2 else "memory.limit_in_bytes")).write_text(str(64 << 20))
    except OSError as error:
        if child.is_dir():
            child.rmdir()
        pytest.skip(f"cannot make a memory cgroup with a limit below {folder}: {error}")
    for swap in ("memory.swap.max", "memory.memsw.limit_in_bytes"):  # no swapping instead of the kill
        try:
            (child / swap).write_text(str(0 if version == 2 else 64 << 20))
        except OSError:
            pass
    yield child
    child.rmdir()


def test_a_rank_killed_by_the_out_of_memory_killer_is_named_so(tmp_path, small_memory_cgroup):
    supervisor = supervise(tmp_path, KILLED_RANK, OOM_CGROUP=str(small_memory_cgroup))
    _, errors = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 128 + signal.SIGKILL, errors
    assert errors.splitlines()[-1] == (
        f"deepy.py: {tmp_path / 'rank.py'} failed (the launcher exited 137); local rank 0 was the first to end: "
        "killed by SIGKILL, likely by the kernel's out-of-memory killer, which ended processes during the run "
        f"(1 in memory cgroup {small_memory_cgroup}, its memory limit 64 MiB); give the ranks more memory or make "
        "them use less; the errors of the other ranks follow from it")


def test_a_plain_sigkill_is_not_named_an_out_of_memory_kill(tmp_path):
    supervisor = supervise(tmp_path, KILLED_RANK)
    _, errors = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 128 + signal.SIGKILL, errors
    assert errors.splitlines()[-1] == (
        f"deepy.py: {tmp_path / 'rank.py'} failed (the launcher exited 137); local rank 0 was the first to end: "
        "killed by SIGKILL; the errors of the other ranks follow from it")

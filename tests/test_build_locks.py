"""A build lock in DeepSpeed's op cache is removed only when it is stale on every host (megatron/host/
build_locks.py): a lock left by an interrupted start goes, a live build's on another host sharing the folder
stays, on NFS too, and a live job on another host that is not building holds no leftover back. The two "hosts"
are two processes whose host names differ (socket.gethostname, which the claims are named by, set in each); a
build on the other host holds its lock open where this host's /proc cannot see it, so the other host's builder
closes its descriptor here. On "nfs", flock is what NFS makes of it: a POSIX lock on the whole file, which needs a
file opened for reading (shared) or writing (exclusive)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.host.build_locks import LOCK_CLAIM_SECONDS, MAX_BUILD_SECONDS, remove_stale_build_locks
from tests.conftest import REPO

HOST = "import socket; socket.gethostname = lambda: {name!r}\n"
NFS = "import fcntl; fcntl.flock = lambda file, operation: fcntl.lockf(file, operation)\n"
BUILDER = """
import sys
from pathlib import Path
from torch.utils.file_baton import FileBaton
from megatron.host.build_locks import hold_build_claim
cache = Path(sys.argv[1])
hold_build_claim(cache)  # as every rank does before anything compiles
if sys.argv[2] == "building":  # as torch's cpp_extension does around a build
    lock = cache / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    baton = FileBaton(str(lock))
    assert baton.try_acquire()
print(sys.argv[2], flush=True)
sys.stdin.readline()  # the build (or the job) ends when the test says so
if sys.argv[2] == "building":
    baton.release()
"""
# This host's /proc does not see the other host's processes and the files they hold open.
REMOVER = """
import sys
from pathlib import Path
from megatron.host import build_locks
build_locks._open_files = set
print([str(path) for path in build_locks.remove_stale_build_locks(Path(sys.argv[1]), poll_seconds=0.1)], flush=True)
"""


def ago(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def on_host(name: str, script: str, cache: Path, *arguments: str, nfs: bool = False) -> subprocess.Popen:
    prelude = HOST.format(name=name) + (NFS if nfs else "")
    return subprocess.Popen([sys.executable, "-c", prelude + script, str(cache), *arguments], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def on_node_a(cache: Path, what: str = "building", nfs: bool = False) -> subprocess.Popen:
    """A rank on node-a: building the op, or running with it built ("running")."""
    builder = on_host("node-a", BUILDER, cache, what, nfs=nfs)
    assert builder.stdout.readline() == f"{what}\n", builder.communicate()
    return builder


def removed_on_node_b(cache: Path, nfs: bool = False) -> tuple[str, str]:
    """What deepy.py on node-b removes, and says; at once (a wait would be an hour's)."""
    remover = on_host("node-b", REMOVER, cache, nfs=nfs)
    try:
        return remover.communicate(timeout=60)
    finally:
        remover.kill()


@pytest.mark.slow
@pytest.mark.parametrize("nfs", [False, True], ids=["local", "nfs"])
def test_a_build_on_another_host_keeps_its_lock_and_deepy_waits_for_it(tmp_path, nfs):
    """Older than LOCK_CLAIM_SECONDS too: its builder's lock on it keeps it."""
    lock = tmp_path / "cpu_adam" / "lock"
    builder = on_node_a(tmp_path, nfs=nfs)
    ago(lock, LOCK_CLAIM_SECONDS + 60)
    remover = on_host("node-b", REMOVER, tmp_path, nfs=nfs)
    time.sleep(3)
    assert lock.is_file() and remover.poll() is None, remover.communicate()
    builder.communicate("done\n", timeout=30)  # the build ends: its lock goes
    removed, waited = remover.communicate(timeout=30)
    assert remover.returncode == 0 and removed == "[]\n", waited
    assert waited.startswith(f"waiting for {lock}: a process of this environment runs as {os.getuid()}@node-a, "
                             "where a build may hold it"), waited


@pytest.mark.slow
@pytest.mark.parametrize("nfs", [False, True], ids=["local", "nfs"])
def test_a_lock_whose_builder_died_on_another_host_is_removed(tmp_path, nfs):
    """On NFS too: the claim and the probe are POSIX locks on files opened the way NFS requires (a shared flock on
    a file opened for writing only, or an exclusive one on a file opened for reading only, is refused there, and
    every leftover would then wait MAX_BUILD_SECONDS)."""
    lock = tmp_path / "cpu_adam" / "lock"
    builder = on_node_a(tmp_path, nfs=nfs)
    builder.kill()  # SIGKILL: its lock stays, its claim goes with it
    builder.communicate()
    removed, said = removed_on_node_b(tmp_path, nfs=nfs)
    assert removed == f"['{lock}']\n" and not lock.exists(), said
    assert f"removed {lock}: left by a start that was interrupted while compiling" in said


@pytest.mark.slow
def test_a_leftover_lock_is_removed_though_another_host_runs_a_job_that_is_not_building(tmp_path):
    """A job of this environment alive on another host (its claim held) does not make a leftover wait
    MAX_BUILD_SECONDS: a lock that nobody holds a lock on, LOCK_CLAIM_SECONDS after it was made, is nobody's
    build."""
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()  # a start interrupted while compiling, here or anywhere
    ago(lock, LOCK_CLAIM_SECONDS + 60)
    job = on_node_a(tmp_path, "running")
    try:
        removed, said = removed_on_node_b(tmp_path)
        assert removed == f"['{lock}']\n" and not lock.exists(), said
    finally:
        job.kill()
        job.communicate()


@pytest.mark.slow
def test_a_lock_older_than_any_build_is_removed_though_another_host_runs(tmp_path):
    lock = tmp_path / "cpu_adam" / "lock"
    builder = on_node_a(tmp_path)  # alive, holding its claim and its lock on the file: a build hung for hours
    try:
        ago(lock, MAX_BUILD_SECONDS + 60)
        removed, _ = removed_on_node_b(tmp_path)
        assert removed == f"['{lock}']\n" and not lock.exists()
    finally:
        builder.kill()
        builder.communicate()


def test_a_lock_nobody_holds_is_removed_and_a_held_one_kept(tmp_path, capsys):
    stale = tmp_path / "cpu_adam" / "lock"  # TORCH_EXTENSIONS_DIR/NAME/lock
    held = tmp_path / "py311_cpu" / "other_op" / "lock"  # torch's default layout
    for lock in (stale, held):
        lock.parent.mkdir(parents=True)
    stale.touch()
    descriptor = os.open(held, os.O_CREAT | os.O_EXCL)  # as torch's FileBaton holds it while building
    try:
        assert remove_stale_build_locks(tmp_path) == [stale]
        assert not stale.exists() and held.exists()
        assert f"removed {stale}: left by a start that was interrupted while compiling" in capsys.readouterr().err
    finally:
        os.close(descriptor)
    assert remove_stale_build_locks(tmp_path) == [held]

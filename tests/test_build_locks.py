"""A build lock in DeepSpeed's op cache is removed only when it is stale on every host (megatron/host/
build_locks.py): a lock left by an interrupted start goes (issue 30, item 3), a live build's on another host sharing
the folder stays (issue 42, item 2). The two "hosts" are two processes whose host names differ (socket.gethostname,
which the claims are named by, set in each); a build on the other host holds its lock open where this host's /proc
cannot see it, so the other host's builder closes its descriptor here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.host.build_locks import MAX_BUILD_SECONDS, remove_stale_build_locks
from tests.conftest import REPO

HOST = "import socket; socket.gethostname = lambda: {name!r}\n"
BUILDER = HOST + """
import os, sys
from pathlib import Path
from megatron.host.build_locks import hold_build_claim
cache = Path(sys.argv[1])
hold_build_claim(cache)  # as every rank does before anything compiles
lock = cache / "deepspeed_shm_comm" / "lock"
lock.parent.mkdir(parents=True, exist_ok=True)
os.close(os.open(lock, os.O_CREAT | os.O_EXCL))  # torch's FileBaton; held open on its own host only
print("building", flush=True)
sys.stdin.readline()  # the build ends when the test says so
lock.unlink()
"""
REMOVER = HOST + """
import sys
from pathlib import Path
from megatron.host.build_locks import remove_stale_build_locks
print([str(path) for path in remove_stale_build_locks(Path(sys.argv[1]), poll_seconds=0.1)], flush=True)
"""


def on_host(name: str, script: str, cache: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script.format(name=name), str(cache)], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def building_on_node_a(cache: Path) -> subprocess.Popen:
    builder = on_host("node-a", BUILDER, cache)
    assert builder.stdout.readline() == "building\n", builder.communicate()
    return builder


@pytest.mark.slow
def test_a_build_on_another_host_keeps_its_lock_and_deepy_waits_for_it(tmp_path):
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    builder = building_on_node_a(tmp_path)
    remover = on_host("node-b", REMOVER, tmp_path)
    time.sleep(3)
    assert lock.is_file() and remover.poll() is None, remover.communicate()
    builder.communicate("done\n", timeout=30)  # the build ends: its lock goes
    removed, waited = remover.communicate(timeout=30)
    assert remover.returncode == 0 and removed == "[]\n", waited
    assert waited.startswith(f"waiting for {lock}: a process of this environment runs as {os.getuid()}@node-a, "
                             "where a build may hold it"), waited


@pytest.mark.slow
def test_a_lock_whose_builder_died_on_another_host_is_removed(tmp_path):
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    builder = building_on_node_a(tmp_path)
    builder.kill()  # SIGKILL: its lock stays, its claim goes with it
    builder.communicate()
    remover = on_host("node-b", REMOVER, tmp_path)
    removed, said = remover.communicate(timeout=30)
    assert removed == f"['{lock}']\n" and not lock.exists()
    assert f"removed {lock}: left by a start that was interrupted while compiling" in said


@pytest.mark.slow
def test_a_lock_older_than_any_build_is_removed_though_another_host_runs(tmp_path):
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    builder = building_on_node_a(tmp_path)  # alive, holding its claim: a long run, no longer building
    try:
        long_ago = time.time() - MAX_BUILD_SECONDS - 60
        os.utime(lock, (long_ago, long_ago))
        remover = on_host("node-b", REMOVER, tmp_path)
        removed, _ = remover.communicate(timeout=30)
        assert removed == f"['{lock}']\n" and not lock.exists()
    finally:
        builder.kill()
        builder.communicate()


def test_a_lock_nobody_holds_is_removed_and_a_held_one_kept(tmp_path, capsys):
    stale = tmp_path / "deepspeed_shm_comm" / "lock"  # TORCH_EXTENSIONS_DIR/NAME/lock
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

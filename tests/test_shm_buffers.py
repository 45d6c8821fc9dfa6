"""DeepSpeed's CPU collectives leave a /dev/shm buffer per rank and never remove it (host/shm_buffers.py): a
run's ranks remove their own when they end, deepy.py removes what a killed run left on its port before
launching, and the removal touches this user's buffers of that one port only, and none a live process maps."""

from __future__ import annotations

import os

import pytest

from megatron.host import shm_buffers
from megatron.host.shm_buffers import PREFIX, SHM_DIRECTORY, remove_port_buffers
from tests.conftest import REPO, run_deepy
from tests.distributed import free_port
from tests.test_training_e2e import data_overrides

UID = os.getuid()


def test_removal_touches_this_users_buffers_of_that_port_only(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_buffers, "SHM_DIRECTORY", tmp_path)
    ours = [f"{PREFIX}_{UID}_127.0.0.1_5000_0", f"{PREFIX}_{UID}_127.0.0.1_5000_1",
            f"{PREFIX}_{UID}_10.1.2.3_5000_12"]
    kept = [f"{PREFIX}_{UID}_127.0.0.1_50001_0", f"{PREFIX}_{UID}_127.0.0.1_15000_0",
            f"{PREFIX}_{UID + 1}_127.0.0.1_5000_0", f"{PREFIX}_{UID}_127.0.0.1_5000_notes", "another_program_5000_0"]
    for name in ours + kept:
        (tmp_path / name).write_bytes(b"x")
    assert remove_port_buffers(5000) == 3
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(kept)


def test_a_buffer_a_live_process_maps_is_kept(tmp_path, monkeypatch):
    """deepy.py keeps the buffers of another, still running, run on the same port."""
    import mmap

    monkeypatch.setattr(shm_buffers, "SHM_DIRECTORY", tmp_path)
    live, dead = tmp_path / f"{PREFIX}_{UID}_127.0.0.1_5000_0", tmp_path / f"{PREFIX}_{UID}_127.0.0.1_5000_1"
    for path in (live, dead):
        path.write_bytes(b"\0" * 4096)
    with open(live, "r+b") as file, mmap.mmap(file.fileno(), 4096):  # mapped by this (live) process
        assert remove_port_buffers(5000) == 1
        assert live.exists() and not dead.exists()
    assert remove_port_buffers(5000) == 1 and not live.exists()


@pytest.mark.slow
def test_a_run_leaves_no_buffer_and_removes_a_killed_runs(demo_data, tmp_path):
    if not SHM_DIRECTORY.is_dir():
        pytest.skip(f"{SHM_DIRECTORY} does not exist here: DeepSpeed's CPU collectives keep no buffers in it")
    port = free_port()
    stale = SHM_DIRECTORY / f"{PREFIX}_{UID}_127.0.0.1_{port}_1"
    stale.write_bytes(b"a killed run's buffer")  # would be mapped as rank 1's by the next run on this port
    run_deepy("train.py", str(REPO / "tests" / "tiny.yml"), *data_overrides(demo_data), "train_iters=4",
              "lr_decay_iters=4", "eval_interval=2", f"save={tmp_path}/checkpoints", f"log_dir={tmp_path}/logs",
              f"master_port={port}")
    assert (tmp_path / "logs" / "metrics.jsonl").is_file()
    assert not list(SHM_DIRECTORY.glob(f"{PREFIX}_*_{port}_*"))

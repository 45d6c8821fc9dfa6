"""A rank joins its own launch's process group only: real gloo processes and TCP stores."""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist

from megatron.config import ConfigError
from megatron.launch.ports import free_port, is_free
from megatron.runtime.rendezvous import KEY, join_launch
from tests.distributed import free_port as unused_port

pytestmark = pytest.mark.slow


def _rank(rank: int, port: int, launch_id: str, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        join_launch(launch_id, "gloo")
        total = torch.tensor([rank + 1])
        dist.all_reduce(total)
        results.put((rank, int(total)))
        dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - the test reads it
        results.put((rank, f"{type(error).__name__}: {error}" if isinstance(error, ConfigError)
                     else traceback.format_exc()))


def run_ranks(port: int, launch_ids: list[str]) -> dict[int, object]:
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=_rank, args=(rank, port, launch_id, results))
                 for rank, launch_id in enumerate(launch_ids)]
    for process in processes:
        process.start()
    found = dict(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    return found


def one_rank(rank: int, port: int, launch_id: str) -> tuple[int, object]:
    """(rank, what it reported) of a single forked rank."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    process = context.Process(target=_rank, args=(rank, port, launch_id, results))
    process.start()
    found = results.get(timeout=120)
    process.join(timeout=60)
    return found


def test_ranks_of_one_launch_join_and_communicate():
    assert run_ranks(unused_port(), ["run-a", "run-a"]) == {0: 3, 1: 3}


def test_a_rank_of_another_launch_stops_instead_of_joining():
    port = unused_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    store.set(KEY, "run-a")  # the first run's rank 0, waiting for its own rank 1
    rank, message = one_rank(1, port, "run-b")
    assert rank == 1 and message == (
        f"ConfigError: rank 1 reached the rendezvous of another run at 127.0.0.1:{port} (launch run-a, this one "
        "run-b) and stopped instead of joining it; give the two runs different master_port values, or leave "
        "master_port unset")
    assert store.num_keys() == 1  # it registered nothing


def test_rank_0_whose_port_was_taken_says_so():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rank, message = one_rank(0, port, "run-b")
    assert rank == 0 and message.startswith(f"ConfigError: master_port {port} on 127.0.0.1 was taken by another "
                                            "program after deepy.py found it free (")


def test_a_chosen_port_is_free_and_below_the_outgoing_range():
    port = free_port()
    outgoing = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert 20000 <= port < max(outgoing, 21000) and is_free(port)

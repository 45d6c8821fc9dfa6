"""Run a function on N real processes joined by a gloo process group (no mocks).

    def body(rank, world_size, *args): ...
    spawn(body, 2, *args)

Each process gets MASTER_ADDR/PORT, RANK and WORLD_SIZE, initialises the
default group, runs `body`, and tears the group down. A failure on any rank
fails the test with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, body: Callable, args: tuple, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        body(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(body: Callable[..., Any], world_size: int, *args: Any) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_entry, args=(world_size, free_port(), body, args, errors), nprocs=world_size,
                           start_method="spawn")
    except Exception as failure:
        details = []
        while not errors.empty():
            rank, text = errors.get()
            details.append(f"--- rank {rank} ---\n{text}")
        raise AssertionError("\n".join(details) or str(failure)) from None

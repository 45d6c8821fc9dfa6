"""Run a function on N real processes joined by a gloo process group (no mocks).

    def body(rank, world_size, *args): ...
    spawn(body, 2, *args)

    results = run_on_ranks(4, function, *args)   # [rank 0's return value, rank 1's, ...]

Each process gets MASTER_ADDR/PORT, RANK and WORLD_SIZE, initialises the
default group, runs the function, and tears the group down. A failure on any
rank fails the test with that rank's traceback, and the processes are stopped.

The processes are forked from the test process, so they start at once with
torch, DeepSpeed, the trainer and what building an engine imports already
imported (the imports below), and with whatever kernels the test process has
already warmed up. Each uses one intra-op thread (OpenMP must
not be used across a fork, and the machine has few cores). Return values travel
back through torch.save, so tensors, dicts and lists are fine.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

# Imported once here, in the test process, rather than in every forked rank, which inherits them: DeepSpeed's
# accelerator and engine and the trainer; torch._dynamo, which torch's first optimizer imports; and inductor's
# compiler, which the ranks of the compiled-layer tests use (about 1,600 modules in all).
import deepspeed.accelerator  # noqa: F401
import torch
import torch._dynamo  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401
import torch.distributed as dist
import torch.multiprocessing as mp

import megatron.training  # noqa: F401


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_rank(rank: int, world_size: int, port: int, function: Callable, args: tuple, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # gloo connects its full mesh in init_process_group; a rank whose side of every pair is up may run a short
        # function and close its sockets before a peer's handshake with it ends ("connectFullMesh failed ...
        # Connection closed by peer" on that peer, seen with three ranks): no rank leaves until all are connected.
        dist.barrier()
        buffer = io.BytesIO()
        torch.save(function(*args), buffer)
        results.put((rank, None, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(world_size: int, function: Callable, *args: Any) -> tuple[list[mp.Process], Any]:
    """The started processes of ranks 0..world_size-1 running `function(*args)`, and the queue of their
    (rank, traceback or None, result) answers. For a test of processes that end the job themselves (os._exit) or
    are stopped: it reads their exit codes and kills what is left."""
    context = mp.get_context("fork")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_run_rank, args=(rank, world_size, port, function, args, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    return processes, results


def run_on_ranks(world_size: int, function: Callable, *args: Any, timeout: float = 300) -> list[Any]:
    """`function(*args)` on ranks 0..world_size-1; returns their results in rank order."""
    processes, results = start_ranks(world_size, function, *args)
    deadline = time.monotonic() + timeout
    outputs: dict[int, Any] = {}
    try:
        while len(outputs) < world_size:
            try:
                rank, error, payload = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                raise AssertionError(f"{function.__name__} on {world_size} ranks: no result in {timeout} s") from None
            if error is not None:
                raise AssertionError(f"{function.__name__} failed on rank {rank} of {world_size}:\n{error}")
            outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
    return [outputs[rank] for rank in range(world_size)]


def _with_rank(body: Callable, args: tuple) -> None:
    body(dist.get_rank(), dist.get_world_size(), *args)


def spawn(body: Callable[..., Any], world_size: int, *args: Any) -> None:
    """`body(rank, world_size, *args)` on every rank, for its assertions."""
    run_on_ranks(world_size, _with_rank, body, args)


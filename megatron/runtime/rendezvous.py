"""Join the process group of this launch only: a rank that reached another run's rendezvous stops.

Two runs on one machine can still meet on a port (both named it, or a race the port choice cannot exclude):
a rank of the second run would then register with the first run's store, and one of the runs would fail minutes
later, or worse, mix. deepy.py gives every launch an identity (`launch_id`); rank 0 publishes it in the store it
creates, every other rank reads it there before it registers, and a rank whose launch it is not stops with
that message. Rank 0 that finds its port taken meanwhile says so instead of torch's EADDRINUSE traceback.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from megatron.config import ConfigError

KEY = "tokenformer/launch_id"
TIMEOUT = timedelta(minutes=30)  # torch's default for process groups: ranks of a large job start unevenly


def join_launch(launch_id: str, backend: str, timeout: timedelta = TIMEOUT) -> None:
    """init_process_group (env:// variables) through a store checked to be `launch_id`'s."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as error:
        if rank == 0:
            raise ConfigError(f"master_port {port} on {address} was taken by another program after deepy.py found "
                              f"it free ({str(error).splitlines()[0]}); start the run again") from None
        raise
    if rank == 0:
        store.set(KEY, launch_id)
    else:
        found = store.get(KEY).decode()
        if found != launch_id:
            raise ConfigError(f"rank {rank} reached the rendezvous of another run at {address}:{port} (launch "
                              f"{found}, this one {launch_id}) and stopped instead of joining it; give the two runs "
                              "different master_port values, or leave master_port unset")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)

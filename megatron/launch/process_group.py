"""Start torch.distributed through DeepSpeed and create the parallel groups.

Device-agnostic: the backend comes from DeepSpeed's accelerator (NCCL on CUDA,
gloo on CPU), so the same entry point runs on a GPU cluster and on this laptop-
class CPU machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
from collections.abc import Callable
from typing import NoReturn

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megatron import mpu
from megatron.checkpoint.commit import CheckpointWriteError
from megatron.checkpoint.reader import CheckpointUnreadable
from megatron.config import Config, ConfigError
from megatron.launch import export_rank_environment
from megatron.launch.config_argument import decode_config
from megatron.launch.extension_cache import use_environment_cache
from megatron.launch.orphan_watch import watch_launcher
from megatron.launch.rendezvous import join_launch
from megatron.launch.shm_buffers import remove_rank_buffer


def communication_backend(cfg) -> str:
    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda":
        return cfg.distributed_backend
    return accelerator.communication_backend_name()


def local_device_index(device_count: int) -> int:
    """This rank's device on its node: LOCAL_RANK (set by every launcher, export_rank_environment included), or
    the global rank in a caller's own process group without it, modulo the devices it sees."""
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        local = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "0")
    return int(local) % device_count


def bind_local_device() -> None:
    """Make this rank's device current; called before the process group starts, as GPT-NeoX does, so that NCCL's
    communicator and barriers use this rank's own device instead of guessing device 0."""
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_device_index(accelerator.device_count()))


def initialize_distributed(cfg) -> mpu.ParallelLayout:
    """init_process_group (once), check the world size, build the groups, seed."""
    started_here = not dist.is_initialized()
    if started_here:
        export_rank_environment(cfg)
    bind_local_device()
    if started_here and cfg.launch_id:
        join_launch(cfg.launch_id, communication_backend(cfg))
    # Also when torch.distributed is already up (a caller's own group): DeepSpeed's collectives, which the
    # pipeline module uses before deepspeed.initialize, then wrap it.
    deepspeed.init_distributed(dist_backend=communication_backend(cfg), verbose=False)
    world = dist.get_world_size()
    if cfg.world_size is not None and cfg.world_size != world:
        raise ConfigError(
            f"the config was resolved for {cfg.world_size} processes but {world} started; "
            "launch through deepy.py, or set num_gpus to the number of processes"
        )
    layout = mpu.initialize_model_parallel(cfg.model_parallel_size, max(1, cfg.pipe_parallel_size))
    set_seed(cfg.seed)
    return layout


def set_seed(seed: int) -> None:
    """The same seed on every rank (replicated dropout draws the same masks), plus the per-tensor-rank
    stream for split activations (mpu/random.py)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)
    mpu.seed_model_parallel_rng(seed)


def share_cores() -> int:
    """Give this rank its share of the cores it may run on, as torchrun does: torch's default of every core per
    process oversubscribes N ranks on one node N-fold. OMP_NUM_THREADS, when set, decides instead. Returns the
    thread count; rank 0 says it once."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // local_ranks)
    torch.set_num_threads(threads)
    if os.environ.get("RANK", "0") == "0":
        print(f"threads: {threads} per process ({cores} cores, {local_ranks} processes per node); "
              "set OMP_NUM_THREADS to choose", flush=True)
    return threads


def run_rank(main: Callable[[Config], object], description: str) -> NoReturn:
    """A rank's entry point (train.py, generate.py, eval.py): `main` on the config deepy.py passed, then the
    process group left and the process ended. An error every rank raises alike (a ConfigError, a damaged
    checkpoint: decided on shared files, or broadcast) is printed once, by rank 0, and exits 2: one message,
    not one traceback per rank. A failed save, which may hit some ranks only, is printed by each rank it hit,
    without the chained traceback of the OS error behind it (the message names it)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--megatron_config", required=True,
                        help="resolved config from deepy.py (zlib-compressed JSON, base64)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by DeepSpeed's launcher")
    cfg = decode_config(parser.parse_args().megatron_config)
    if cfg.flash_backend == "triton" and get_accelerator().device_name() == "cpu":
        # Triton kernels on a CPU run under Triton's interpreter, switched on before anything imports triton.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    share_cores()
    watch_launcher()
    use_environment_cache()  # as deepy.py does, for ranks started without it (srun, mpirun by hand)
    code = 1
    try:
        main(cfg)
        code = 0
    except (ConfigError, CheckpointUnreadable) as error:
        if not dist.is_initialized() or dist.get_rank() == 0:
            label = "config error" if isinstance(error, ConfigError) else "error"
            print(f"{label}: {error}", file=sys.stderr, flush=True)
        code = 2
    except CheckpointWriteError as error:
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"error (rank {rank}): {error}", file=sys.stderr, flush=True)
    finally:
        leave_process_group(finished=code == 0)
    end_process(code)


def leave_process_group(finished: bool = True) -> None:
    """Destroy the process group; when every rank `finished`, only after a barrier, so that no rank shuts its
    connections while another is still in a collective, and this rank's shared-memory buffer of DeepSpeed's CPU
    collectives is removed (shm_buffers.py). (After an error some ranks may not reach the barrier:
    the launcher stops the rest when the failed rank exits.)"""
    if dist.is_initialized():
        if finished:
            dist.barrier()
            remove_rank_buffer(dist.get_rank())
        dist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """Exit with `code` once output is flushed, without the interpreter's teardown: process groups still
    referenced by DeepSpeed's and our module globals would be destroyed there in no set order, and gloo then
    aborts a finished rank now and then ("terminate called without an active exception", exit -6). Every file
    the run writes is closed and synced before this point (checkpoints commit, the metrics log is closed)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

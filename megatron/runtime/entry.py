"""A rank's entry and exit, the same for train.py, generate.py and eval.py: the config deepy.py passed, the
process prepared, the script's `main`, errors reported once, the process group left and the process ended."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megatron.checkpoint.commit import CheckpointWriteError
from megatron.config import Config, ConfigError
from megatron.config.argument import decode_config
from megatron.config.schema import TRITON_FLASH_BACKENDS
from megatron.data.token_ids import TokenIdError
from megatron.formats.deepspeed.reader import CheckpointUnreadable
from megatron.host.extension_cache import use_environment_cache
from megatron.host.orphan_watch import watch_launcher
from megatron.runtime.agreed_error import AgreedError
from megatron.runtime.collectives import is_output_rank
from megatron.runtime.environment import local_process_count
from megatron.runtime.process_group import leave_process_group
from megatron.runtime.settings import RuntimeSettings


def share_cores() -> int:
    """Give this rank its share of the cores it may run on, as torchrun does: torch's default of every core per
    process oversubscribes N ranks on one node N-fold. OMP_NUM_THREADS, when set, decides instead. Returns the
    thread count; rank 0 says it once."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    local_ranks = local_process_count()
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // local_ranks)
    torch.set_num_threads(threads)
    if os.environ.get("RANK", "0") == "0":
        print(f"threads: {threads} per process ({cores} cores, {local_ranks} processes per node); "
              "set OMP_NUM_THREADS to choose", flush=True)
    return threads


# The allocator's settings: torch 2.13's name first, then the older CUDA-only one it still reads.
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def allocator_settings(device_name: str, environ: dict[str, str]) -> dict[str, str]:
    """Environment for the device's memory allocator, set before its first allocation: on CUDA, PyTorch's
    expandable segments unless PYTORCH_ALLOC_CONF (or the older PYTORCH_CUDA_ALLOC_CONF) says otherwise. A
    training step allocates buffers of very different sizes in turn (activations in forward, flat gradient and
    master-weight partitions in the optimizer step); with fixed segments the cache fragments, and near the card's
    capacity every step frees the whole cache and retries the allocation, each time waiting for the device
    (docs/performance.md)."""
    if device_name != "cuda" or any(name in environ for name in ALLOCATOR_VARIABLES):
        return {}
    return {ALLOCATOR_VARIABLES[0]: "expandable_segments:True"}


def use_training_allocator(device_name: str | None = None) -> None:
    """Give this process the allocator settings a rank of deepy.py's gets on `device_name` (by default the
    accelerator's), before its first device allocation: what a benchmark measures in its own process is then
    what training gets."""
    os.environ.update(allocator_settings(device_name or get_accelerator().device_name(), os.environ))


def _prepare_process(settings: RuntimeSettings) -> None:
    """What a rank sets before its script's work: the device allocator's settings, Triton's interpreter where the
    kernels run on a CPU, its share of the cores, the watch on deepy.py, the extension cache (as deepy.py does,
    for ranks started without it: srun, mpirun by hand)."""
    use_training_allocator()
    if settings.flash_backend in TRITON_FLASH_BACKENDS and get_accelerator().device_name() == "cpu":
        # Triton kernels on a CPU run under Triton's interpreter, switched on before anything imports triton.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    share_cores()
    watch_launcher()
    use_environment_cache()


def run_rank(main: Callable[[Config], object], description: str) -> NoReturn:
    """A rank's entry point (train.py, generate.py, eval.py, cluster_check.py): `main` on the config deepy.py
    passed, then the process group left and the process ended; an int `main` returns is the exit status (the
    cluster check's 3 when a section failed). An error every rank raises alike (a ConfigError, a damaged
    checkpoint: decided on shared files, or broadcast; an AgreedError such as too many non-finite steps) is
    printed once, by rank 0, and exits 2: one message, not one traceback per rank. A failed save or a token id
    outside the vocabulary, which hit some ranks only, is printed by each rank it hit, without the chained
    traceback behind it (the message names the cause), and exits 1. Any other error prints its traceback and
    exits 1 through end_process too: left to the interpreter, the exit could abort instead."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--megatron_config", help="resolved config from deepy.py (zlib-compressed JSON, base64)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by DeepSpeed's launcher")
    parser.add_argument("by_hand", nargs="*", help=argparse.SUPPRESS)  # a config file given as to deepy.py
    options = parser.parse_args()
    if options.megatron_config is None or options.by_hand:
        script = Path(sys.argv[0]).name
        parser.exit(2, f"{script} runs on the processes deepy.py starts, with the config deepy.py checked: "
                       f"python deepy.py {script} CONFIG.yml [CONFIG.yml ...] [key=value ...]\n")
    cfg = decode_config(options.megatron_config)
    _prepare_process(RuntimeSettings.from_config(cfg))
    code, finished = 1, False
    try:
        returned = main(cfg)
        finished = True
        code = returned if isinstance(returned, int) and not isinstance(returned, bool) else 0
    except Exception as error:  # noqa: BLE001 (reported, then the exit without the teardown below)
        code = reported(error)
    finally:
        leave_process_group(finished=finished)
    end_process(code)


def reported(error: Exception) -> int:
    """Print `error` as a rank ends on it (run_rank's docstring); returns the exit status."""
    if isinstance(error, (ConfigError, CheckpointUnreadable, AgreedError)):
        if is_output_rank():
            label = "config error" if isinstance(error, ConfigError) else "error"
            print(f"{label}: {error}", file=sys.stderr, flush=True)
        return 2
    if isinstance(error, (CheckpointWriteError, TokenIdError)):
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"error (rank {rank}): {error}", file=sys.stderr, flush=True)
        return 1
    traceback.print_exception(error)
    return 1


def end_process(code: int) -> NoReturn:
    """Exit with `code` once output is flushed, without the interpreter's teardown: process groups still
    referenced by DeepSpeed's and our module globals would be destroyed there in no set order, and gloo then
    aborts a finished rank now and then ("terminate called without an active exception", exit -6). Every file
    the run writes is closed and synced before this point (checkpoints commit, the metrics log is closed)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

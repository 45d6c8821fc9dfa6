"""This machine's memory and cores against what a launch puts on it, checked before any process starts: found
after, they end in a node-wide out-of-memory kill (which can take other jobs' processes on a shared node) after
minutes of work, or in ranks that take turns on too few cores.

- the memory: the ranks this machine runs, each its host memory (below), plus, when rank 0 runs here, the
  train data's sample index, which rank 0 builds in memory before training while the other ranks wait
  (megatron/data/sample_index.py, blending_index.py count its arrays as the builder allocates them);
- the cores: more local ranks than cores get a note.

A rank's host memory is RANK_HOST_BYTES (its runtime) plus, on a CPU, where its model states and activations
live too, the memory model's figure for them (megatron/model/rank_memory.py); on an accelerator those are in
device memory, the memory model's business (pattention_impl: auto). Only this machine is checked: a
hostfile's other hosts are not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from megatron.config import Config
from megatron.config.run_inputs import CLUSTER_CHECK_SCRIPT, INFERENCE_SCRIPTS
from megatron.data.blending_index import blending_build_bytes, most_samples_taken, normalized_weights
from megatron.data.data_utils import train_split_tokens
from megatron.data.indexed_dataset import IndexedDatasetError, index_file_path, read_index_header, sequence_sizes
from megatron.data.sample_index import index_build_bytes
from megatron.growth.plan import padded_vocabulary
from megatron.launch.hosts import is_local_host
from megatron.launch.resources import Slots
from megatron.model import TokenFormerArgs
from megatron.model.memory import GIB, NotModelled
from megatron.model.rank_memory import RunShape, training_bytes_per_rank

# A rank's host memory besides its model (torch and DeepSpeed imported, gloo, the engine, the data), measured for
# tests/tiny.yml on a 2-core CPU machine: peak RSS 0.47 GiB a rank (train_iters=2; 0.25 GiB of it the imports),
# and 0.43 GiB a rank when 64 ran at once (issue 59). RSS counts the shared libraries in each process, so the bound
# takes less than both: it refuses only launches that cannot fit.
RANK_HOST_BYTES = int(0.4 * GIB)


def local_processes(cfg: Config, slots: Slots) -> int:
    """The ranks this machine runs: the slots of its own hosts under pdsh (srun and mpirun place ranks on the
    allocation's nodes, which may not include this one)."""
    if cfg.launcher != "pdsh":
        return 0
    return sum(len(ids) for host, ids in slots.items() if is_local_host(host))


def _script(cfg: Config) -> str:
    return Path(cfg.user_script or "train.py").name


def rank_host_bytes(cfg: Config, device: str) -> int:
    """One rank's host memory (module docstring); a training rank's model by the memory model, pattention_impl
    auto counted as flash, the smaller, which it takes where fused would not fit."""
    if device != "cpu" or cfg.model_type != "tokenformer" or _script(cfg) in INFERENCE_SCRIPTS:
        return RANK_HOST_BYTES
    args = TokenFormerArgs.from_config(cfg, padded_vocab_size=padded_vocabulary(cfg))
    impl = "flash" if cfg.pattention_impl == "auto" else cfg.pattention_impl
    try:
        return RANK_HOST_BYTES + training_bytes_per_rank(args, impl, RunShape.from_config(cfg), device)
    except NotModelled:  # attention dropout: the host's share alone, so that only what surely cannot fit is refused
        return RANK_HOST_BYTES


def _dataset_tokens(prefix: str) -> np.ndarray:
    idx_path = index_file_path(prefix)
    return sequence_sizes(idx_path, read_index_header(idx_path))


@dataclass(frozen=True)
class IndexBuild:
    """One index array set rank 0 builds in memory before training: what it is, with its arrays' sizes, and the
    most it holds at once (bytes)."""

    what: str
    peak: int


def _prefix_index(prefix: str, split: str, num_samples: int, seq_length: int) -> IndexBuild:
    """Building the train part of `split` of `prefix` for `num_samples` samples."""
    documents, tokens = train_split_tokens(split, _dataset_tokens(prefix))
    built = index_build_bytes(documents, tokens, seq_length, num_samples)
    return IndexBuild(f"the sample index of {prefix}'s train data ({built.epochs:,} epochs of {documents:,} documents: "
                      f"doc_idx {_gib(built.doc_idx)}, sample_idx {_gib(built.sample_idx)}, shuffle_idx "
                      f"{_gib(built.shuffle_idx)})", built.peak)


def _train_indices(cfg: Config) -> list[IndexBuild]:
    """Every train index rank 0 builds, one after another: data_path's train split, or each of train_data_paths
    with the most samples their blend takes of it, and the blend's own index."""
    num_samples = cfg.train_iters * cfg.train_batch_size
    if not cfg.train_data_paths:
        return [_prefix_index(cfg.data_path, cfg.split, num_samples, cfg.seq_length)] if cfg.data_path else []
    if len(cfg.train_data_paths) == 1:
        return [_prefix_index(cfg.train_data_paths[0], "1,0,0", num_samples, cfg.seq_length)]
    weights = cfg.train_data_weights
    if weights is None:  # the natural mixture, as the ranks weigh it
        weights = [float(np.sum(_dataset_tokens(prefix), dtype=np.int64)) for prefix in cfg.train_data_paths]
    counts = most_samples_taken(normalized_weights(weights), num_samples)
    blend = IndexBuild(f"the blend index of the {len(counts)} train_data_paths ({num_samples:,} samples)",
                       blending_build_bytes(num_samples))
    return [blend, *(_prefix_index(prefix, "1,0,0", int(count), cfg.seq_length)
                     for prefix, count in zip(cfg.train_data_paths, counts))]


def _largest_train_index(cfg: Config) -> IndexBuild | None:
    """The train index whose build holds the most at once; None without one (or with data the preflight refuses)."""
    if cfg.eval_only or _script(cfg) in (*INFERENCE_SCRIPTS, CLUSTER_CHECK_SCRIPT):
        return None
    try:
        indices = _train_indices(cfg)
    except (OSError, IndexedDatasetError, ValueError):
        return None  # preflight_problems names it
    return max(indices, key=lambda index: index.peak, default=None)


def _gib(size: int) -> str:
    """`size` bytes for a message: 3,814.7 GiB, 0.40 GiB, 1.8 MiB, 56.2 KiB."""
    if size >= GIB:
        return f"{size / GIB:,.1f} GiB"
    if size >= GIB // 10:
        return f"{size / GIB:.2f} GiB"
    if size >= 2**20:
        return f"{size / 2**20:.1f} MiB"
    return f"{size / 2**10:.1f} KiB"


def node_memory_problems(cfg: Config, slots: Slots, device: str, available: int | None = None) -> list[str]:
    """The launch refused when its ranks on this machine, and the sample index rank 0 builds here first, need
    more than `available` bytes (by default what this machine has available now); [] if they fit."""
    processes = local_processes(cfg, slots)
    if not processes:
        return []
    available = psutil.virtual_memory().available if available is None else available
    rank_zero_here = is_local_host(next(iter(slots)))
    index = _largest_train_index(cfg) if rank_zero_here else None
    index_bytes = index.peak if index else 0
    if index_bytes > available:
        return [f"train_iters = {cfg.train_iters} x train_batch_size {cfg.train_batch_size}: rank 0 would first "
                f"build {index.what}, {_gib(index.peak)} at once, more than the {_gib(available)} this machine has "
                "available; lower train_iters, or train on more text"]
    per_rank = rank_host_bytes(cfg, device)
    if processes * per_rank + index_bytes <= available:
        return []
    model = per_rank - RANK_HOST_BYTES
    parts = f"{_gib(RANK_HOST_BYTES)} a rank's runtime"
    if model:
        parts += f" + {_gib(model)} its model states and activations by the memory model"
    index_part = f" + {_gib(index_bytes)} for rank 0's sample index" if index_bytes else ""
    fit = max(0, (available - index_bytes) // per_rank)
    return [f"{processes} processes on this machine need about {processes} x {_gib(per_rank)} ({parts}){index_part} "
            f"= {_gib(processes * per_rank + index_bytes)} of host memory, more than the {_gib(available)} it has "
            f"available; lower num_gpus (at most {fit} fit), or free memory"]


def node_core_notes(cfg: Config, slots: Slots) -> list[str]:
    """A note when this machine runs more ranks than it has cores: each gets a share of one, so start-up and
    every step take that much longer (megatron/runtime/entry.py gives each rank its share of threads)."""
    processes, cores = local_processes(cfg, slots), len(os.sched_getaffinity(0))
    if processes <= cores:
        return []
    return [f"{processes} processes on this machine's {cores} cores: the ranks take turns on them, so start-up and "
            f"every step are about {processes / cores:.3g}x slower than with a core each; lower num_gpus to {cores} "
            "if that is not intended"]

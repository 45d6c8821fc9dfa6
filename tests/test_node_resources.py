"""deepy.py bounds what a launch puts on this machine before any process starts (megatron/launch/node_resources.py):
the ranks' host memory and the sample index rank 0 builds first, against the memory this machine has available,
and more ranks than cores. Launched, a run that does not fit is killed by the kernel's out-of-memory killer after
minutes (taking other jobs' processes with it on a shared node), saying nothing of memory."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import psutil
import pytest

import deepy
from megatron.config import load_config
from megatron.data.blending_index import blending_build_bytes, build_blending_indices
from megatron.data.sample_index import (build_doc_idx, build_sample_idx, build_shuffle_idx, index_build_bytes,
                                        num_epochs_needed)
from megatron.host.extension_cache import VARIABLE
from megatron.launch.node_resources import RANK_HOST_BYTES, node_core_notes, node_memory_problems, rank_host_bytes
from megatron.model.memory import GIB
from tests.conftest import REPO
from tests.test_dataset_check import write_dataset
from tests.test_launch_preflight import TWO_RANKS, corpus, run_config

# The machine of issue 59: 23.5 GiB, two cores.
ISSUE_MACHINE = int(23.5 * GIB)


@pytest.mark.parametrize("num_samples", [10, 1_000, 200_000])
def test_the_sample_index_is_counted_as_the_builder_allocates_it(num_samples):
    """Each array's bytes exactly, and the peak the build holds at once, against a real build (compiled helper)."""
    sizes = np.full(100, 100, dtype=np.int32)
    documents = np.arange(90)
    epoch_tokens = int(sizes[:90].sum())
    counted = index_build_bytes(90, epoch_tokens, 64, num_samples)
    tracemalloc.start()
    rng = np.random.RandomState(1)
    epochs = num_epochs_needed(epoch_tokens, 64, num_samples)
    doc_idx = build_doc_idx(documents, epochs, rng)
    sample_idx = build_sample_idx(sizes, doc_idx, 64, epochs, epoch_tokens)
    shuffle_idx = build_shuffle_idx(len(sample_idx) - 1, rng)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert (counted.epochs, counted.doc_idx, counted.sample_idx, counted.shuffle_idx) == (
        epochs, doc_idx.nbytes, sample_idx.nbytes, shuffle_idx.nbytes)
    assert counted.peak <= peak <= counted.peak + 64 * 1024  # numpy's and the generator's own few KiB besides
    assert blending_build_bytes(num_samples) == sum(array.nbytes for array in
                                                    build_blending_indices(np.array([1.0, 3.0]), num_samples))


def test_a_sample_index_larger_than_this_machine_is_refused_with_its_figures(tmp_path):
    """train_iters = 10^11 passed the 2^63-sample bound; launched, rank 0 built the index for 8 minutes and was
    killed by the out-of-memory killer at 23 GB."""
    cfg = run_config(tmp_path, "train_iters=100000000000")
    [problem] = node_memory_problems(cfg, TWO_RANKS, "cpu", ISSUE_MACHINE)
    prefix = cfg.data_path
    assert problem == (
        f"train_iters = 100000000000 x train_batch_size 16: rank 0 would first build the sample index of {prefix}'s "
        "train data (11,377,777,778 epochs of 90 documents: doc_idx 3,814.7 GiB, sample_idx 23,841.9 GiB, "
        "shuffle_idx 11,920.9 GiB), 39,577.5 GiB at once, more than the 23.5 GiB this machine has available; lower "
        "train_iters, or train on more text")
    assert node_memory_problems(cfg, TWO_RANKS, "cpu")  # no machine holds it
    assert node_memory_problems(run_config(tmp_path), TWO_RANKS, "cpu", ISSUE_MACHINE) == []


def test_a_blend_is_bounded_by_its_largest_index(tmp_path):
    """train_data_paths: the blend's own index and each dataset's, for the most samples the blend takes of it."""
    big = write_dataset(str(tmp_path / "big_text_document"), [[7] * 100] * 90)
    small = write_dataset(str(tmp_path / "small_text_document"), [[7] * 10] * 9)
    cfg = run_config(tmp_path, "data_path=null", f"train_data_paths=[{big}, {small}]", "train_data_weights=[1, 1]",
                     "train_iters=100000000")
    [problem] = node_memory_problems(cfg, TWO_RANKS, "cpu", ISSUE_MACHINE)
    assert problem == (f"train_iters = 100000000 x train_batch_size 16: rank 0 would first build the sample index "
                       f"of {small}'s train data (568,888,892 epochs of 9 documents: doc_idx 19.1 GiB, sample_idx "
                       "11.9 GiB, shuffle_idx 3.0 GiB), 38.1 GiB at once, more than the 23.5 GiB this machine has "
                       "available; lower train_iters, or train on more text")


def test_more_ranks_than_this_machine_holds_are_refused_with_the_per_rank_figure(tmp_path):
    """num_gpus = 64 on the 23.5 GiB machine: 0.43 GiB a rank, three ranks taken by the out-of-memory killer and
    3,642 lines of gloo tracebacks from the others."""
    ranks = {"localhost": list(range(64))}
    cfg = run_config(tmp_path, "num_gpus=64", world_size=64)
    per_rank = rank_host_bytes(cfg, "cpu")
    assert RANK_HOST_BYTES < per_rank < RANK_HOST_BYTES + 0.01 * GIB  # tiny.yml's model: a few MiB
    [problem] = node_memory_problems(cfg, ranks, "cpu", ISSUE_MACHINE)
    assert problem == ("64 processes on this machine need about 64 x 0.40 GiB (0.40 GiB a rank's runtime + "
                       f"{(per_rank - RANK_HOST_BYTES) / 2**20:.1f} MiB its model states and activations by the memory "
                       "model) + 452.3 KiB for rank 0's sample index = 25.7 GiB of host memory, more than the 23.5 GiB it "
                       "has available; lower num_gpus (at most 58 fit), or free memory")
    assert node_memory_problems(cfg, {"node-a": list(range(64))}, "cpu", ISSUE_MACHINE) == []  # not this machine
    assert rank_host_bytes(cfg, "cuda") == RANK_HOST_BYTES  # its model is in device memory


def test_dropout_is_counted_or_leaves_the_runtime_share_alone(tmp_path):
    """Hidden dropout's masks are in the estimate; attention dropout, which the memory model does not cover,
    leaves a rank the runtime's share, so that deepy.py refuses only what surely cannot fit (both raised inside
    deepy.py before)."""
    plain = rank_host_bytes(run_config(tmp_path, "num_gpus=2", world_size=2), "cpu")
    assert rank_host_bytes(run_config(tmp_path, "num_gpus=2", "hidden_dropout=0.1", world_size=2), "cpu") > plain
    attention = run_config(tmp_path, "num_gpus=2", "attention_dropout=0.1", world_size=2)
    assert rank_host_bytes(attention, "cpu") == RANK_HOST_BYTES
    assert node_memory_problems(attention, TWO_RANKS, "cpu", ISSUE_MACHINE) == []


def test_normal_runs_fit(tmp_path):
    """configs/demo.yml on the issue's machine (tests/tiny.yml: above); 1-5B's 8 ranks on a big node, with their
    model in host memory (about 10.6 GiB a rank on a CPU) or in device memory."""
    demo = load_config([REPO / "configs" / "demo.yml"], [f"data_path={corpus(tmp_path / 'data')}",
                                                          "tokenizer_type=CharLevelTokenizer"], world_size=2)
    assert node_memory_problems(demo, TWO_RANKS, "cpu", ISSUE_MACHINE) == []
    large = load_config([REPO / "configs" / "1-5B.yml"], [f"data_path={demo.data_path}",
                                                           "tokenizer_type=CharLevelTokenizer"], world_size=8)
    for device in ("cpu", "cuda"):
        assert node_memory_problems(large, {"localhost": list(range(8))}, device, 256 * GIB) == []


def test_deepy_refuses_more_ranks_than_this_machine_holds_before_launching(tmp_path, monkeypatch, capsys):
    """As many ranks as this machine's memory cannot hold at RANK_HOST_BYTES each: one line, exit 2, nothing
    started."""
    monkeypatch.setenv(VARIABLE, os.environ.get(VARIABLE) or str(tmp_path / "extensions"))
    processes = psutil.virtual_memory().total // RANK_HOST_BYTES + 1
    text = write_dataset(str(tmp_path / "text_document"), [[7] * 1000] * (processes * 64 // 900 + 2))  # a batch
    code = deepy.main(["train.py", str(REPO / "tests" / "tiny.yml"), f"data_path={text}",
                       "tokenizer_type=CharLevelTokenizer", f"num_gpus={processes}", "train_micro_batch_size_per_gpu=1",
                       "gradient_accumulation_steps=1"])
    out, err = capsys.readouterr()
    assert code == 2 and "launching" not in out, out
    [line] = err.splitlines()
    assert line.startswith(f"config error: {processes} processes on this machine need about {processes} x "), line


def test_more_ranks_than_cores_get_a_note(tmp_path):
    cores = len(os.sched_getaffinity(0))
    cfg = run_config(tmp_path, f"num_gpus={cores * 4}", world_size=cores * 4)
    [note] = node_core_notes(cfg, {"localhost": list(range(cores * 4))})
    assert note == (f"{cores * 4} processes on this machine's {cores} cores: the ranks take turns on them, so start-up "
                    f"and every step are about 4x slower than with a core each; lower num_gpus to {cores} if that is "
                    "not intended")
    assert node_core_notes(cfg, {"localhost": list(range(cores))}) == []

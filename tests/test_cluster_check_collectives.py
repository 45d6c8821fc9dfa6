"""The collectives section's value checks on 4 forked gloo ranks placed as on two nodes, ranks 0 and 3 on one and
1 and 2 on the other: the groups across nodes are [0, 1] and [2, 3] in new_group's order (not host order, which
read as wrong values), and an all-reduce that goes wrong on one rank only from 4 MiB up (as a protocol switch
would) fails the section naming that rank and each size, though the small buffers' check passed. And the numerics
section on 2 ranks at TP = 2: healthy it passes; with rank 1's tensor-parallel all-reduce 1 % off it fails."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from megatron.cluster_check import collectives
from megatron.cluster_check.context import CheckContext
from megatron.cluster_check.ranks import Ranks
from megatron.cluster_check.report import FAIL, PASS, SectionResult
from megatron.config import load_config
from tests.conftest import REPO
from tests.distributed import run_on_ranks

PLACEMENT = Ranks(("node-a", "node-b", "node-b", "node-a"))
WRONG_RANK = 2
WRONG_FROM = collectives.CPU_SIZES[1]  # bytes: the first size above the smallest


def _section_with_one_rank_wrong_at_large_sizes() -> tuple[SectionResult, list[int]]:
    """Rank body: the section, rank WRONG_RANK's all-reduce off by one in its first element from WRONG_FROM bytes
    (the real collective runs; its result is then damaged); and this rank's across-nodes members."""
    if dist.get_rank() == WRONG_RANK:
        real = dist.all_reduce

        def damaged(tensor: torch.Tensor, *args, **kwargs):
            work = real(tensor, *args, **kwargs)
            if tensor.numel() * tensor.element_size() >= WRONG_FROM:
                tensor[0] += 1
            return work

        dist.all_reduce = damaged
    cfg = load_config([REPO / "tests" / "tiny.yml"], ["data_path=d", "num_gpus=4"], world_size=4)
    context = CheckContext(cfg, PLACEMENT, torch.device("cpu"), "t")
    return collectives.run(context), collectives.Groups(context).kinds["across nodes"][1]


@pytest.mark.slow
def test_groups_follow_new_groups_order_and_values_are_checked_at_every_size():
    results = run_on_ranks(4, _section_with_one_rank_wrong_at_large_sizes, timeout=120)
    result = results[0][0]
    assert result.status == FAIL and result.facts == {"correct": False}, result
    [finding] = result.findings  # the small buffers were right everywhere: the placement's groups included
    assert finding.where == "rank 2 on node-b"
    sizes = [size // collectives.MIB for size in collectives.CPU_SIZES if size >= WRONG_FROM]
    assert finding.what == "wrong values from " + ", ".join(
        f"all-reduce {kind} at {size} MiB" for kind in ("world", "within a node", "across nodes") for size in sizes)
    assert [members for _, members in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def _numerics(tokenizer: str, damaged: bool) -> SectionResult:
    """Rank body: the numerics section of a TP = 2 layout; `damaged`: rank 1's tensor-parallel all-reduce 1 % off
    (the real collective runs; its result is then scaled), where the TP = 1 reference has no such reduction."""
    from megatron import mpu
    from megatron.cluster_check import numerics
    from megatron.runtime.process_group import initialize_distributed

    if damaged and dist.get_rank() == 1:
        real = dist.all_reduce

        def scaled(tensor: torch.Tensor, *args, **kwargs):
            work = real(tensor, *args, **kwargs)
            if kwargs.get("group") is not None and kwargs["group"] is mpu.get_tensor_parallel_group() and \
                    mpu.get_tensor_parallel_world_size() > 1:
                tensor.mul_(1.01)
            return work

        dist.all_reduce = scaled
    cfg = load_config([REPO / "tests" / "tiny.yml"], ["data_path=d", f"vocab_file={tokenizer}", "num_gpus=2",
                                                      "model_parallel_size=2"], world_size=2)
    initialize_distributed(cfg)  # as cluster_check.py's ranks start: the parallel groups, the seeds
    return numerics.run(CheckContext(cfg, Ranks.gather(), torch.device("cpu"), "t"), save_shared=False)


@pytest.mark.slow
def test_a_reduction_wrong_on_one_rank_fails_numerics(demo_data):
    tokenizer = str(demo_data / "tokenizer.json")
    [healthy, _] = run_on_ranks(2, _numerics, tokenizer, False, timeout=300)
    assert (healthy.status, healthy.findings) == (PASS, []), healthy
    [damaged, _] = run_on_ranks(2, _numerics, tokenizer, True, timeout=300)
    assert damaged.status == FAIL and damaged.findings, damaged
    assert all(f.where == "layout TP 2 x PP 0 x DP 1 (ranks 0, 1 on " + socket.gethostname() + ")"
               for f in damaged.findings), damaged.findings
    assert damaged.findings[0].what.startswith("step 1 "), damaged.findings

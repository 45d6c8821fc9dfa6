"""The collectives section's value checks on 4 forked gloo ranks placed as on two nodes, ranks 0 and 3 on one and
1 and 2 on the other: the groups across nodes are [0, 1] and [2, 3] in new_group's order (not host order, which
read as wrong values), and an all-reduce that goes wrong on one rank only from 4 MiB up (as a protocol switch
would) fails the section naming that rank and each size, though the small buffers' check passed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.cluster_check import collectives
from megatron.cluster_check.context import CheckContext
from megatron.cluster_check.ranks import Ranks
from megatron.cluster_check.report import FAIL, SectionResult
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

"""Each communication mapping, forward and backward, on 4 real gloo processes split into tensor-parallel
groups of 2 and of 4: outputs and input gradients against the forward/backward table in mappings.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron import mpu
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.slow

WORLD = 4
SHAPE = (4, 3, 8)
DIMS = (0, -1)
WITH_DIM = ("scatter_to_region", "gather_from_region", "reduce_scatter_to_region", "all_gather_to_region")
WITHOUT_DIM = ("copy_to_region", "reduce_from_region", "all_reduce_to_region")


def random(seed: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def apply_each_mapping() -> dict:
    """On every rank: (input, upstream gradient, output, input gradient) of each mapping, per group size."""
    rank = dist.get_rank()
    results = {}
    for tensor_size in (2, 4):
        mpu.initialize_model_parallel(tensor_size)
        cases = [(name, None) for name in WITHOUT_DIM] + [(name, dim) for name in WITH_DIM for dim in DIMS]
        for case, (name, dim) in enumerate(cases):
            x = random(100 * rank + case, SHAPE).requires_grad_()
            output = getattr(mpu, name)(x) if dim is None else getattr(mpu, name)(x, dim)
            upstream = random(1000 + 100 * rank + case, output.shape)
            (output * upstream).sum().backward()
            results[(tensor_size, name, dim)] = (x.detach(), upstream, output.detach(), x.grad)
        x = random(rank, SHAPE)
        results[(tensor_size, "all_reduce_max", None)] = (x, None, mpu.all_reduce_max(x), None)
        mpu.destroy_model_parallel()
    return results


def expected(name: str, dim: int | None, inputs: list, upstreams: list, index: int):
    """(output, input gradient) of group member `index`, from every member's input and upstream gradient."""
    own_block = (lambda t: t.chunk(len(inputs), dim=dim)[index]) if dim is not None else None
    x_sum, upstream_sum = sum(inputs), sum(upstreams) if upstreams[0] is not None else None
    if name == "copy_to_region":
        return inputs[index], upstream_sum
    if name == "reduce_from_region":
        return x_sum, upstreams[index]
    if name == "all_reduce_to_region":
        return x_sum, upstream_sum
    if name == "scatter_to_region":
        return own_block(inputs[index]), torch.cat(upstreams, dim=dim)
    if name == "gather_from_region":
        return torch.cat(inputs, dim=dim), own_block(upstreams[index])
    if name == "reduce_scatter_to_region":
        return own_block(x_sum), torch.cat(upstreams, dim=dim)
    if name == "all_gather_to_region":
        return torch.cat(inputs, dim=dim), own_block(upstream_sum)
    return torch.stack(inputs).amax(dim=0), None  # all_reduce_max


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(WORLD, apply_each_mapping)


CASES = ([(name, None) for name in WITHOUT_DIM] + [(name, dim) for name in WITH_DIM for dim in DIMS]
         + [("all_reduce_max", None)])


@pytest.mark.parametrize("tensor_size", [2, 4])
@pytest.mark.parametrize("name, dim", CASES)
def test_mapping_forward_and_backward(ranks, tensor_size, name, dim):
    for group_start in range(0, WORLD, tensor_size):  # tensor-parallel groups are blocks of adjacent ranks
        group = [ranks[r][(tensor_size, name, dim)] for r in range(group_start, group_start + tensor_size)]
        inputs, upstreams = [g[0] for g in group], [g[1] for g in group]
        for index, (_, _, output, grad) in enumerate(group):
            want_output, want_grad = expected(name, dim, inputs, upstreams, index)
            torch.testing.assert_close(output, want_output, msg=f"{name} forward, group rank {index}")
            if want_grad is None:
                assert grad is None and not output.requires_grad
            else:
                torch.testing.assert_close(grad, want_grad, msg=f"{name} backward, group rank {index}")


@pytest.mark.parametrize("name, dim", CASES)
def test_with_one_rank_every_mapping_returns_its_input(name, dim):
    x = torch.randn(3, 4)
    assert (getattr(mpu, name)(x) if dim is None else getattr(mpu, name)(x, dim)) is x

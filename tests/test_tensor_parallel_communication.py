"""The per-layer communication figure of docs/tensor_parallel.md, checked by counting the payloads of the
collectives one TokenFormer layer actually calls, forward and backward, on real tensor-parallel ranks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from benchmarks.tp_traffic import tokenformer_bytes_per_token
from megatron import mpu
from megatron.model import TokenFormerArgs
from megatron.model.layer import TokenFormerLayer
from megatron.mpu.collectives import Collective, count_collectives
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.slow

HIDDEN, BATCH, SEQ = 16, 2, 8
TOKENS = BATCH * SEQ
STATISTIC_BYTES = 4  # Pattention row statistics are fp32 whatever the activations are
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NORM_TYPES = ("l2_norm_gelu", "softmax")


def documented_payloads(d: int, element_size: int, norm_type: str) -> dict[str, Counter]:
    """Per token, per pass: (collective, bytes per element) -> elements, as tabulated in the doc."""
    statistics_forward = 10 if norm_type == "softmax" else 5  # softmax also all-reduces a row max
    forward = Counter({("reduce_scatter", element_size): 3 * d, ("all_gather", element_size): d})
    forward[("all_reduce", element_size)] += 2 * d
    forward[("all_reduce", STATISTIC_BYTES)] += statistics_forward
    backward = Counter({("all_gather", element_size): 3 * d, ("reduce_scatter", element_size): d})
    backward[("all_reduce", element_size)] += 2 * d
    backward[("all_reduce", STATISTIC_BYTES)] += 5
    return {"forward": forward, "backward": backward}


def one_layer_pass(norm_type: str, dtype: torch.dtype) -> dict[str, list[Collective]]:
    """Collectives of one layer's forward and backward, at the current tensor-parallel size."""
    args = TokenFormerArgs(padded_vocab_size=8, hidden_size=HIDDEN, num_layers=1, num_attention_heads=4,
                           qkv_slot_num=8, proj_slot_num=8, ffn_slot_num=16, seq_length=SEQ,
                           norm_activation_type=norm_type)
    layer = TokenFormerLayer(args).to(dtype)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    with count_collectives() as forward:
        y = layer(x)
    with count_collectives() as backward:
        y.backward(torch.ones_like(y))
    return {"forward": list(forward), "backward": list(backward)}


def count_on_ranks(tensor_size: int) -> dict:
    mpu.initialize_model_parallel(tensor_size)
    mpu.seed_model_parallel_rng(0)
    return {(norm_type, name): one_layer_pass(norm_type, dtype)
            for norm_type in NORM_TYPES for name, dtype in DTYPES.items()}


def per_token(collectives: list[Collective]) -> Counter:
    counts = Counter()
    for collective in collectives:
        counts[(collective.kind, collective.element_size)] += collective.numel / TOKENS
    return counts


@pytest.fixture(scope="module")
def warm_kernels():
    """One single-rank pass of each kind first, so the forked ranks start with warm torch kernels."""
    for norm_type in NORM_TYPES:
        for dtype in DTYPES.values():
            one_layer_pass(norm_type, dtype)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def counted(request, warm_kernels):
    return request.param, run_on_ranks(request.param, count_on_ranks, request.param)[0]


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_collective_payloads_per_layer_match_the_documented_table(counted, norm_type, dtype_name):
    tensor_size, results = counted
    element_size = DTYPES[dtype_name].itemsize
    expected = documented_payloads(HIDDEN, element_size, norm_type)
    calls = results[(norm_type, dtype_name)]
    for direction in ("forward", "backward"):
        assert per_token(calls[direction]) == expected[direction], direction
    assert (len(calls["forward"]), len(calls["backward"])) == ((14, 9) if norm_type == "softmax" else (9, 9))
    sent = sum(c.bytes_sent_per_rank(tensor_size) for c in calls["forward"] + calls["backward"]) / TOKENS
    assert sent == pytest.approx(tokenformer_bytes_per_token(HIDDEN, tensor_size, element_size, norm_type))

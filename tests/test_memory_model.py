"""The memory model's formula (megatron/model/memory.py) equals the bytes autograd saves, measured on a tiny
model: every Pattention implementation and Θ, bf16 and fp32, several sequences per micro-batch, learned and no
position embeddings, τ ≠ 1, activation checkpointing, hidden dropout. Equal to the byte: the formula counts
storages, so any missing, extra or mis-sized term fails. And the micro-batch fit follows from the formula and the
stated ZeRO-1 accounting."""

import dataclasses

import pytest
import torch

from benchmarks.memory_model import measured_saved_bytes
from megatron.model.memory import (
    NotModelled,
    max_micro_batch,
    model_state_bytes,
    parameter_count,
    peak_activation_bytes,
    saved_bytes,
)
from megatron.model import TokenFormerArgs
from megatron.model.args import NORM_ACTIVATIONS, PATTENTION_IMPLS

# n distinct from d and from each other, so that a term with the wrong width shows.
TINY = TokenFormerArgs(padded_vocab_size=100, hidden_size=32, num_layers=2, num_attention_heads=4, qkv_slot_num=40,
                       proj_slot_num=48, ffn_slot_num=136, seq_length=24, rotary_pct=0.25, seed=5)


def check(args: TokenFormerArgs, dtype: torch.dtype, batch: int, group: int | None = None) -> None:
    formula = saved_bytes(args, args.pattention_impl, dtype, "cpu").total(args.num_layers, batch, args.seq_length,
                                                                          group)
    assert formula == measured_saved_bytes(args, dtype, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_type", NORM_ACTIVATIONS)
@pytest.mark.parametrize("impl", PATTENTION_IMPLS)
def test_formula_equals_the_measured_saved_bytes(impl, norm_type, dtype):
    check(dataclasses.replace(TINY, pattention_impl=impl, norm_activation_type=norm_type), dtype, batch=3)


@pytest.mark.parametrize("impl", PATTENTION_IMPLS)
@pytest.mark.parametrize("options", [{"pos_emb": "learned"}, {"pos_emb": "none"}, {"pattention_tau": 0.5},
                                     {"no_weight_tying": True, "final_norm": "layernorm_nonparam"}])
def test_formula_holds_for_the_other_options(impl, options):
    check(dataclasses.replace(TINY, pattention_impl=impl, **options), torch.bfloat16, batch=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", PATTENTION_IMPLS)
def test_hidden_dropout_adds_its_masks(impl, dtype):
    check(dataclasses.replace(TINY, pattention_impl=impl, hidden_dropout=0.1), dtype, batch=3)


def test_attention_dropout_is_not_modelled():
    with pytest.raises(NotModelled, match="attention dropout"):
        saved_bytes(dataclasses.replace(TINY, attention_dropout=0.1), "fused", torch.bfloat16)


@pytest.mark.parametrize("group", [1, 2])
def test_checkpointing_keeps_each_groups_input(group):
    args = dataclasses.replace(TINY, num_layers=3, checkpoint_activations=True, checkpoint_num_layers=group)
    check(args, torch.bfloat16, batch=2, group=group)


def test_flash_bytes_do_not_grow_with_n_and_plain_and_fused_do():
    def per_token(impl, n):
        args = dataclasses.replace(TINY, qkv_slot_num=n, proj_slot_num=n, ffn_slot_num=4 * n)
        return saved_bytes(args, impl, torch.bfloat16, "cuda").layer_per_token

    assert per_token("flash", 64) == per_token("flash", 4096)
    assert per_token("fused", 4096) > per_token("fused", 64) and per_token("plain", 4096) > per_token("plain", 64)


def test_largest_micro_batch_is_the_last_that_fits_the_budget():
    args = dataclasses.replace(TINY, num_layers=4, seq_length=512, max_position_embeddings=512)
    gpu, reserve, ranks = 2**30, 0.1, 8
    budget = (1 - reserve) * gpu - model_state_bytes(parameter_count(args), ranks)
    for impl in PATTENTION_IMPLS:
        for checkpointing in (False, True):
            batch = max_micro_batch(args, impl, checkpointing, gpu, reserve, ranks)
            assert batch > 0
            assert peak_activation_bytes(args, impl, torch.bfloat16, batch, checkpointing) <= budget
            assert peak_activation_bytes(args, impl, torch.bfloat16, batch + 1, checkpointing) > budget
        assert max_micro_batch(args, impl, True, gpu, reserve, ranks) > max_micro_batch(args, impl, False, gpu,
                                                                                         reserve, ranks)


def test_model_states_are_zero_1_bf16_with_fp32_adam_sharded():
    assert model_state_bytes(1000, 8) == 2000 + 2000 + 1500
    assert model_state_bytes(1000, 1) == 16000

"""pattention_impl: auto (megatron/training/pattention_choice.py): fused unless the memory model says a training
step of the micro-batch would not fit the device with it; the per-rank estimate follows the memory model's
accounting, and tensor parallelism, ZeRO and precision move it the way they move a real run."""

import dataclasses
import math

import torch
from deepspeed.accelerator import get_accelerator

from megatron.config import Config
from megatron.model import TokenFormerArgs
from megatron.model.memory import model_state_bytes, parameter_count, peak_activation_bytes
from megatron.training.pattention_choice import (
    RESERVE,
    RunShape,
    choose_pattention_impl,
    resolve_pattention_impl,
    training_bytes_per_rank,
)
from tests.test_config import MINIMAL

ARGS = TokenFormerArgs(padded_vocab_size=1024, hidden_size=128, num_layers=4, num_attention_heads=4,
                       qkv_slot_num=512, proj_slot_num=512, ffn_slot_num=2048, seq_length=256, rotary_pct=0.25)
SHAPE = RunShape(micro_batch=8, precision="bfloat16", zero_stage=1, data_parallel=8, tensor_parallel=1,
                 pipeline_parallel=1)


def test_the_estimate_is_the_memory_models_zero1_accounting():
    for impl in ("fused", "flash"):
        expected = (model_state_bytes(parameter_count(ARGS), 8)
                    + peak_activation_bytes(ARGS, impl, torch.bfloat16, 8, checkpointing=False, device="cuda"))
        assert training_bytes_per_rank(ARGS, impl, SHAPE, "cuda") == expected


def test_fused_while_it_fits_then_flash():
    fused = training_bytes_per_rank(ARGS, "fused", SHAPE, "cuda")
    flash = training_bytes_per_rank(ARGS, "flash", SHAPE, "cuda")
    assert flash < fused
    just_enough = math.ceil(fused / (1 - RESERVE))
    assert choose_pattention_impl(ARGS, SHAPE, "cuda", just_enough)[0] == "fused"
    impl, why = choose_pattention_impl(ARGS, SHAPE, "cuda", just_enough - 64)
    assert impl == "flash"
    assert f"fused would need {fused / 2**30:.1f} GiB, flash {flash / 2**30:.1f} GiB" in why


def test_tensor_parallelism_zero_and_precision_move_the_estimate():
    base = training_bytes_per_rank(ARGS, "fused", SHAPE, "cuda")
    assert training_bytes_per_rank(ARGS, "fused", dataclasses.replace(SHAPE, tensor_parallel=2), "cuda") < base
    assert training_bytes_per_rank(ARGS, "fused", dataclasses.replace(SHAPE, zero_stage=0), "cuda") > base
    assert training_bytes_per_rank(ARGS, "fused", dataclasses.replace(SHAPE, precision="fp32"), "cuda") > base
    assert training_bytes_per_rank(ARGS, "fused", dataclasses.replace(SHAPE, micro_batch=16), "cuda") > base


def test_a_named_implementation_is_kept_and_auto_is_the_default():
    config = Config.from_dict(MINIMAL)
    assert config.pattention_impl == "auto"
    args = TokenFormerArgs.from_config(config, padded_vocab_size=128)
    impl, why = resolve_pattention_impl(config, args, get_accelerator())  # this CPU: a tiny model fits
    assert impl == "fused" and why.startswith("fused fits")
    flash = Config.from_dict({**MINIMAL, "pattention_impl": "flash"})
    assert resolve_pattention_impl(flash, args, get_accelerator()) == ("flash", None)


def test_models_built_outside_training_take_fused_for_auto():
    config = Config.from_dict(MINIMAL)
    assert TokenFormerArgs.from_config(config, padded_vocab_size=128).pattention_impl == "fused"

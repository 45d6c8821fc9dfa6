"""pattention_impl: auto (megatron/training/pattention_choice.py): fused unless the memory model says a training
step of the micro-batch would not fit the device with it; the per-rank estimate follows the memory model's
accounting, and tensor parallelism, ZeRO and precision move it the way they move a real run."""

import dataclasses
import math

from deepspeed.accelerator import get_accelerator

from megatron.config import Config
from megatron.model import TokenFormerArgs
from megatron.model.rank_memory import RunShape, training_bytes_per_rank
from megatron.training.pattention_choice import RESERVE, choose_pattention_impl, resolve_pattention_impl
from tests.test_config import MINIMAL

ARGS = TokenFormerArgs(padded_vocab_size=1024, hidden_size=128, num_layers=4, num_attention_heads=4,
                       qkv_slot_num=512, proj_slot_num=512, ffn_slot_num=2048, seq_length=256, rotary_pct=0.25)
SHAPE = RunShape(micro_batch=8, precision="bfloat16", zero_stage=1, data_parallel=8, tensor_parallel=1,
                 pipeline_parallel=1)


def test_the_estimate_is_the_memory_models_accounting_worked_out_by_hand():
    """ARGS at micro-batch 8 (2048 tokens), bf16, ZeRO-1 over 8 ranks, on a GPU: the bytes written out term by
    term from the memory model's docstring (megatron/model/memory.py), not computed by its functions."""
    e, z, d, h, r, vocab, tokens, layers = 2, 4, 128, 4, 8, 1024, 8 * 256, 4
    parameters = vocab * d + layers * (3 * 2 * 512 * d + 2 * 512 * d + 2 * 2048 * d) + 2 * d  # tied; final norm
    assert parameters == 4_325_632
    states = (2 + 2) * parameters + 12 * parameters // 8  # bf16 weights and gradients; master, m, v sharded
    per_layer_token = (2 * (e * d + 2 * z)  # the two norms' inputs and statistics
                       + 2 * e * d  # the inputs of Q/K/V and of the FFN
                       + 2 * e * d + 3 * e * d + e * d + 4 * h)  # rotated Q, K; Q/K/V output; SDPA output, LSE
    per_layer = 2 * 4 * (r // 2) * 256 + 5 * 4  # rotary cos and sin (fp32) per position; the five token counts
    model_token = 9 + (e * d + 2 * z) + e * d + (e * vocab + 3 * 4 + 8 + 1)  # ids, final norm, logits input, loss
    loss_transient = e * vocab + 4 * vocab  # the logits' gradient; rows upcast to fp32 (one block: all 2048)
    fused_pattentions = 3 * (e * 512 + 8) + (e * 512 + 8) + (e * 2048 + 8)  # the kept scores, statistic, row factor
    flash_pattentions = 5 * 8  # the statistic and the row factor only
    for impl, pattentions, expected in (("fused", fused_pattentions, 130_397_648), ("flash", flash_pattentions,
                                                                                 63_288_784)):
        layer_bytes = (per_layer_token + pattentions) * tokens + per_layer
        activations = layers * layer_bytes + (model_token + loss_transient) * tokens
        assert states + activations == expected
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


def test_attention_dropout_which_the_memory_model_does_not_cover_takes_fused_and_says_why():
    impl, why = choose_pattention_impl(dataclasses.replace(ARGS, attention_dropout=0.1), SHAPE, "cuda", 64)
    assert impl == "fused" and why.startswith("the memory model covers no attention dropout (the paper configs have "
                                              "none): fused")
    dropout = dataclasses.replace(ARGS, hidden_dropout=0.1)  # counted: its masks move the estimate
    assert training_bytes_per_rank(dropout, "fused", SHAPE, "cuda") > training_bytes_per_rank(ARGS, "fused", SHAPE,
                                                                                                "cuda")


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

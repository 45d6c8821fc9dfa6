"""tools/model_summary.py and the counts/FLOPs behind it, checked against the configs and a real model."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from torch.utils.flop_counter import FlopCounterMode

from megatron.model import TokenFormerArgs, TokenFormerModel, flops_per_token
from megatron.model.parameter_count import count_parameters_by_component
from megatron.model.spec import layer_token_count

REPO = Path(__file__).resolve().parents[1]


def load_tool():
    spec = importlib.util.spec_from_file_location("model_summary", REPO / "tools" / "model_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool(capsys, *argv):
    load_tool().main([str(a) for a in argv])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("config, nominal", [
    ("150M.yml", 150e6), ("450M.yml", 450e6), ("900M.yml", 900e6), ("1-5B.yml", 1.5e9)])
def test_released_sizes_match_their_names(capsys, config, nominal):
    summary = run_tool(capsys, REPO / "configs" / config, "--json")
    assert abs(summary["total_params"] / nominal - 1) < 0.15
    components = ("embedding", "attention", "ffn", "norms", "output")
    assert sum(summary[c] for c in components) == summary["total_params"]
    assert summary["flops_per_token"] > 6 * summary["total_params"]  # 6N plus attention, recompute


def test_vocab_size_flag_sets_the_embedding_rows(capsys):
    summary = run_tool(capsys, REPO / "configs" / "150M.yml", "--json", "--vocab-size", 1000)
    assert summary["embedding"] == 1000 * 768


def test_the_vocabulary_is_the_config_tokenizers_padded_as_a_run_pads_it(capsys, tmp_path):
    """The demo model was counted with a 50,304-row embedding (7.5M parameters where it has 2.1M) whatever its
    tokenizer, and the tool did not say which vocabulary it assumed."""
    tokens = ["<|endoftext|>", *(f"t{i}" for i in range(299))]
    tokenizer = Tokenizer(WordLevel({token: i for i, token in enumerate(tokens)}, unk_token="<|endoftext|>"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    demo = REPO / "configs" / "demo.yml"
    load_tool().main([str(demo), f"vocab_file={tmp_path / 'tokenizer.json'}", "--json"])
    printed = capsys.readouterr()
    assert json.loads(printed.out)["embedding"] == 384 * 128  # 300 tokens padded to a multiple of 128, width 128
    assert "assuming" not in printed.err

    load_tool().main([str(demo), f"vocab_file={tmp_path / 'missing.json'}", "--json"])
    printed = capsys.readouterr()
    assert json.loads(printed.out)["embedding"] == 50304 * 128
    assert printed.err.endswith(
        f"model_summary.py: vocab_file {tmp_path / 'missing.json'} not found (tokenizer_type HFTokenizer): assuming a "
        "vocabulary of 50304 rows (GPT-NeoX-20B's, padded); give --vocab-size N or the tokenizer's file for the "
        "config's\n")


def tiny_args(**overrides) -> TokenFormerArgs:
    values = dict(padded_vocab_size=40, hidden_size=16, num_layers=3, num_attention_heads=4, qkv_slot_num=8,
                  proj_slot_num=12, ffn_slot_num=20, seq_length=10, rotary_pct=0.5)
    values.update(overrides)
    return TokenFormerArgs(**values)


@pytest.mark.parametrize("overrides", [
    {}, dict(no_weight_tying=True), dict(pos_emb="learned", norm="layernorm"), dict(final_norm="layernorm_nonparam")])
def test_meta_count_equals_a_materialised_model_and_the_closed_form(overrides):
    args = tiny_args(**overrides)
    counts = count_parameters_by_component(TokenFormerModel(args, device="meta"))
    materialised = TokenFormerModel(args)
    assert counts["total_params"] == sum(p.numel() for p in materialised.parameters())

    d, vocab = args.hidden_size, args.padded_vocab_size
    pattention_tokens = layer_token_count(vars(args))
    block_norms = 2 * 2 * d if args.norm == "layernorm" else 0
    final_norm = 2 * d if args.final_norm == "layernorm" else 0
    closed_form = (vocab * d * (2 if args.no_weight_tying else 1)
                   + (args.max_position_embeddings * d if args.pos_emb == "learned" else 0)
                   + args.num_layers * (2 * d * pattention_tokens + block_norms) + final_norm)
    assert counts["total_params"] == closed_form


@pytest.mark.parametrize("model_type", ["tokenformer", "transformer"])
def test_forward_flops_match_a_flop_counter_and_recompute_adds_one_layer_forward(model_type):
    # The formula counts the model's FLOPs (MFU's convention); the fused node runs exactly those GEMMs, while
    # flash adds, in backward, the recomputed scores. The dense baseline: its
    # linear layers' GEMMs (biases are element-wise, not counted).
    args = tiny_args(pattention_impl="fused", model_type=model_type)
    model = TokenFormerModel(args)
    batch = 2
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # math path: countable bmm
        model(torch.zeros(batch, args.seq_length, dtype=torch.long))
    forward_per_token = counter.get_total_flops() // (batch * args.seq_length)
    assert flops_per_token(args, include_recompute=False) == 3 * forward_per_token

    logits_per_token = 2 * args.hidden_size * args.padded_vocab_size
    recompute = flops_per_token(args, include_recompute=True) - flops_per_token(args, include_recompute=False)
    assert recompute == forward_per_token - logits_per_token


def test_a_tokenformer_summary_gives_the_dense_baseline_of_equal_size(capsys):
    summary = run_tool(capsys, REPO / "configs" / "450M.yml", "--json")
    args = TokenFormerArgs(padded_vocab_size=50304, hidden_size=1024, num_layers=24, num_attention_heads=16,
                           qkv_slot_num=None, proj_slot_num=None, ffn_slot_num=None, seq_length=2048,
                           model_type="transformer")
    assert summary["dense_same_shape_params"] == count_parameters_by_component(
        TokenFormerModel(args, device="meta"))["total_params"]
    heads = summary["dense_equal_params_num_attention_heads"]
    assert summary["dense_equal_params_hidden_size"] == 64 * heads
    assert abs(summary["dense_equal_params"] / summary["total_params"] - 1) < 0.05

    def total(h):
        return count_parameters_by_component(TokenFormerModel(
            dataclasses.replace(args, hidden_size=64 * h, num_attention_heads=h), device="meta"))["total_params"]
    gap = abs(summary["dense_equal_params"] - summary["total_params"])
    assert gap == abs(total(heads) - summary["total_params"])
    assert gap <= min(abs(total(h) - summary["total_params"]) for h in (heads - 1, heads + 1))

"""The model's one declaration of its Pattentions (megatron/model/spec.py): the model builds exactly what it
declares, and everything that counts, sizes, grows, splits, initialises or exports Pattentions follows a made-up
sixth one added to the declaration with no other edit. The sixth, `branch`, is a second FFN Pattention reading
the FFN's input, its output added to the FFN's: the test puts it in both forward passes (the framework's layer
and the exported remote code's), the one thing a new kind of Pattention needs besides its spec entry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.memory_model import measured_saved_bytes
from megatron import mpu
from megatron.checkpoint.parameter_state import ParameterState
from megatron.config import load_config
from megatron.config.schema import TOKEN_COUNT_KEYS
from megatron.formats.huggingface import from_hf_state, hf_config, to_hf_state, token_counts
from megatron.formats.official import from_official, official_key, to_official
from megatron.formats.tensor_parallel import merge_shards, split_dimensions, split_state
from megatron.growth.grow import grown_states
from megatron.growth.plan import pattention_entry, plan_growth
from megatron.model import TokenFormerArgs, TokenFormerModel, flops_per_token
from megatron.model import spec as model_spec
from megatron.model.init_methods import parameter_roles
from megatron.model.flops import layer_pattention_flops_per_token
from megatron.model.init_roles import InitRole
from megatron.model.layer import TokenFormerLayer
from megatron.model.memory import parameter_count, saved_bytes
from megatron.model.parameter_count import count_parameters_by_component
from megatron.model.spec import PattentionSpec, layer_pattentions, slot_keys
from tests.conftest import REPO
from tests.distributed import run_on_ranks

TINY = REPO / "tests" / "tiny.yml"
BRANCH = PattentionSpec("branch", "ffn_slot_num", "branch", "ffn_branch", "ffn", key_init=InitRole.OUTPUT,
                        value_init=InitRole.INPUT)


def config(*overrides: str):
    return load_config([TINY], ["padded_vocab_size=256", *overrides])


def model(cfg, device: str = "cpu") -> TokenFormerModel:
    return TokenFormerModel(TokenFormerArgs.from_config(cfg), device=device)


def forward_with_branch(layer, x, cache=None):
    """TokenFormerLayer.forward with the branch beside the FFN (the framework's layer; hf_forward_with_branch:
    the exported one's)."""
    x = x + F.dropout(layer.attention(layer.input_layernorm(x), cache), layer.hidden_dropout, layer.training)
    h = layer.post_attention_layernorm(x)
    return x + F.dropout(layer.mlp(h) + layer.branch(h), layer.hidden_dropout, layer.training)


def hf_forward_with_branch(layer, x, position_ids, attention_mask=None, past_key_values=None):
    attended = layer.attention(layer.input_layernorm(x), position_ids, attention_mask, past_key_values)
    x = x + F.dropout(attended, layer.hidden_dropout, layer.training)
    h = layer.post_attention_layernorm(x)
    return x + F.dropout(layer.mlp(h) + layer.branch(h), layer.hidden_dropout, layer.training)


@pytest.fixture
def with_branch(monkeypatch):
    """The spec with a sixth Pattention, `branch` (ffn_slot_num tokens) directly in each layer, and the layer's
    forward computing with it."""
    monkeypatch.setattr(model_spec, "LAYER_PATTENTIONS", (*model_spec.LAYER_PATTENTIONS, BRANCH))
    monkeypatch.setattr(TokenFormerLayer, "forward", forward_with_branch)


def tiny_args(**overrides) -> TokenFormerArgs:
    """n distinct from d and from each other, so a term of the wrong width shows."""
    values = dict(padded_vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4, qkv_slot_num=40,
                  proj_slot_num=48, ffn_slot_num=72, seq_length=16, rotary_pct=0.25, seed=5,
                  pattention_impl="fused")
    return TokenFormerArgs(**{**values, **overrides})


def test_the_config_s_token_count_keys_are_the_spec_s_slot_keys():
    assert set(TOKEN_COUNT_KEYS) == set(slot_keys())


def test_the_model_builds_exactly_the_declared_pattentions_split_along_the_declared_dimension():
    built = model(config(), "meta")
    for i, layer in enumerate(built.layers):
        for spec in layer_pattentions():
            pattention = layer.get_submodule(spec.path)
            assert pattention.key_param_tokens.partition_dim == spec.split_dim
    paths = {name for name, module in built.layers[0].named_modules() if hasattr(module, "key_param_tokens")}
    assert paths == {spec.path for spec in layer_pattentions()}


def test_a_declared_pattention_no_module_builds_is_refused(monkeypatch):
    nowhere = PattentionSpec("attention.inner.gate", "ffn_slot_num", "gate", "gate", "attention")
    monkeypatch.setattr(model_spec, "LAYER_PATTENTIONS", (*model_spec.LAYER_PATTENTIONS, nowhere))
    with pytest.raises(ValueError, match=r"builds the Pattentions \['attention.key', .*'mlp'\] but megatron/model/"
                                         r"spec.py declares .*'attention.inner.gate'"):
        model(config(), "meta")


def test_a_declared_pattention_is_built_and_initialised_with_its_declared_roles(with_branch):
    cfg = config()
    built = model(cfg)
    branch = built.layers[1].branch
    assert tuple(branch.key_param_tokens.shape) == (cfg.ffn_slot_num, cfg.hidden_size)
    assert int(branch.norm_token_count) == cfg.ffn_slot_num
    roles = parameter_roles(built)
    assert roles["layers.1.branch.key_param_tokens"] is InitRole.OUTPUT
    assert roles["layers.1.branch.value_param_tokens"] is InitRole.INPUT
    assert branch.key_param_tokens.std() > 0
    assert not torch.equal(branch.key_param_tokens, built.layers[1].mlp.key_param_tokens)


def test_flops_count_every_declared_pattention(monkeypatch):
    args = TokenFormerArgs.from_config(config())
    before = flops_per_token(args, False)
    monkeypatch.setattr(model_spec, "LAYER_PATTENTIONS", (*model_spec.LAYER_PATTENTIONS, BRANCH))
    d, n = args.hidden_size, args.ffn_slot_num
    assert flops_per_token(args, False) - before == 3 * args.num_layers * (2 * d * n + 2 * n * d)


def test_the_flops_formula_equals_a_layer_s_measured_matrix_products(with_branch):
    """The layer's matrix products, counted by torch's FlopCounterMode in a real forward with the branch in it,
    are the formula's Pattention FLOPs (attention's SDPA is counted apart, and not by the counter on a CPU)."""
    args = tiny_args()
    tokens = torch.randint(0, args.padded_vocab_size, (2, args.seq_length), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        TokenFormerModel(args)(tokens)
    measured = sum(counter.get_flop_counts()["TokenFormerModel.layers.0"].values())
    assert measured == layer_pattention_flops_per_token(args) * tokens.numel()
    assert "TokenFormerModel.layers.0.branch" in counter.get_flop_counts()


def test_the_parameter_count_follows_a_declared_pattention(with_branch):
    args = tiny_args()
    counts = count_parameters_by_component(TokenFormerModel(args, device="meta"))
    assert counts["ffn"] == args.num_layers * 2 * (2 * args.ffn_slot_num * args.hidden_size)  # mlp and branch
    assert counts["total_params"] == parameter_count(args) == sum(p.numel() for p in TokenFormerModel(args).parameters())


@pytest.mark.parametrize("impl", ["plain", "fused", "flash"])
def test_the_memory_model_equals_the_measured_bytes_with_a_declared_pattention(with_branch, impl):
    args = tiny_args(pattention_impl=impl, flash_backend="pytorch")
    formula = saved_bytes(args, impl, torch.float32, "cpu").total(args.num_layers, 2, args.seq_length)
    assert formula == measured_saved_bytes(args, torch.float32, batch=2)


def test_growth_grows_a_declared_pattention(with_branch):
    source_cfg = config()
    source = model(source_cfg).state_dict()
    plan = plan_growth(source_cfg, config("ffn_slot_num=512"))
    name = "layers.0.branch.key_param_tokens"
    assert pattention_entry(name) == ("ffn_slot_num", "key_param_tokens")
    assert plan.source_shape(name) == (256, 64) and plan.target_shapes[name] == (512, 64)
    grown = {n: s.weight for n, s in grown_states(source, lambda n: ParameterState(source[n]), plan)}
    assert torch.equal(grown[name][:256], source[name]) and not grown[name][256:].any()
    assert grown["layers.0.branch.value_param_tokens"].shape == (512, 64)
    assert int(grown["layers.0.branch.norm_token_count"]) == 256


def test_preserving_growth_of_a_declared_pattention_keeps_the_function(with_branch):
    source_cfg = config("growth_mode=preserve")
    target_cfg = config("growth_mode=preserve", "ffn_slot_num=384")
    source = model(source_cfg)
    state = source.state_dict()
    grown = {n: s.weight for n, s in grown_states(state, lambda n: ParameterState(state[n]), plan_growth(
        source_cfg, target_cfg))}
    target = model(target_cfg)
    target.load_state_dict(grown)
    assert target.layers[0].branch.key_param_tokens.shape[0] == 384
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(target(tokens), source(tokens), rtol=1e-5, atol=1e-6)


def test_the_tensor_parallel_layout_splits_a_declared_pattention(with_branch):
    cfg = config()
    dims = split_dimensions(TokenFormerArgs.from_config(cfg))
    assert dims["layers.0.branch.key_param_tokens"] == 0 and dims["layers.0.branch.norm_token_count"] is None
    state = model(cfg).state_dict()
    shards = split_state(state, dims, 2)
    assert shards[1]["layers.0.branch.value_param_tokens"].shape == (128, 64)
    assert all(torch.equal(merged, state[name]) for name, merged in merge_shards(shards, dims).items())


def branch_logits(tensor_parallel: int) -> torch.Tensor:
    """The whole vocabulary's logits of the tiny model with the branch at this tensor-parallel size."""
    mpu.initialize_model_parallel(tensor_parallel)
    mpu.seed_model_parallel_rng(0)
    args = tiny_args()
    tokens = torch.randint(0, args.padded_vocab_size, (2, args.seq_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return mpu.gather_from_region(TokenFormerModel(args)(tokens), dim=-1)


@pytest.mark.slow
def test_tensor_parallelism_computes_a_declared_pattention_as_one_rank_does(with_branch):
    single = TokenFormerModel(tiny_args())
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = single(tokens)
        single.layers[0].branch.value_param_tokens.zero_()
        assert not torch.allclose(single(tokens), expected)  # the branch is in the forward pass
    for logits in run_on_ranks(2, branch_logits, 2):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


def test_the_hugging_face_and_official_formats_carry_a_declared_pattention(with_branch):
    cfg = config()
    args = TokenFormerArgs.from_config(cfg)
    state = model(cfg).state_dict()
    counts = token_counts(state, args.num_layers)
    assert counts[0]["branch"] == cfg.ffn_slot_num
    config_json = hf_config(args, counts, None)
    assert config_json["pattention_slot_keys"]["branch"] == "ffn_slot_num"
    back = from_hf_state(to_hf_state(state), config_json, "test")
    assert set(back) == set(state) and all(torch.equal(back[name], state[name]) for name in state)
    assert official_key("layers.0.branch.key_param_tokens", args.num_layers) == "sequential.2.ffn_branch.key_param_tokens"
    official = to_official(state, args.num_layers, args.pattention_tau)
    assert "sequential.3.ffn_branch.value_param_tokens" in official
    back = from_official(official, args)
    assert set(back) == set(state) and all(torch.equal(back[name], state[name]) for name in state)


def test_a_declared_pattention_survives_loading_the_hugging_face_model(with_branch, tmp_path, monkeypatch):
    """The exported remote code builds every Pattention config.json declares and keeps its weights; with the
    branch in its forward too, it computes the framework's logits."""
    from transformers import AutoModelForCausalLM

    from megatron.formats.huggingface import write_hf_directory

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = config()
    built = model(cfg).eval()
    state = built.state_dict()
    write_hf_directory(state, cfg, tmp_path / "hf", max_shard_bytes=2**40)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True, local_files_only=True)
    loaded = hf.state_dict()
    for i in range(cfg.num_layers):
        for leaf in ("key_param_tokens", "value_param_tokens"):
            assert torch.equal(loaded[f"model.layers.{i}.branch.{leaf}"], state[f"layers.{i}.branch.{leaf}"])
    assert hf.model.layers[1].branch.norm_token_count == cfg.ffn_slot_num
    monkeypatch.setattr(type(hf.model.layers[0]), "forward", hf_forward_with_branch)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, built(tokens), rtol=1e-5, atol=1e-5)


def test_the_remote_code_default_names_the_declared_pattentions():
    """The transformers configuration copied beside exported weights cannot import the framework; its default for a
    config.json without pattention_slot_keys and pattention_paths must be the spec's (transformers: a dev
    requirement)."""
    from megatron.hf.configuration_tokenformer import RELEASE_PATHS, RELEASE_PATTENTIONS

    assert RELEASE_PATTENTIONS == {spec.hf_name: spec.slot_key for spec in layer_pattentions()}
    assert RELEASE_PATHS == {spec.hf_name: spec.path for spec in layer_pattentions()}

"""The model's one declaration of its Pattentions (megatron/model/spec.py): the model builds exactly what it
declares, and growth, the tensor-parallel layout, initialisation, FLOPs, the official and Hugging Face formats
and the Hugging Face model (the exported remote code) follow a made-up extra kind of Pattention added to the
declaration with no other edit."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpoint.parameter_state import ParameterState
from megatron.config import load_config
from megatron.formats.huggingface import from_hf_state, hf_config, to_hf_state, token_counts
from megatron.formats.official import from_official, official_key, to_official
from megatron.formats.tensor_parallel import merge_shards, split_dimensions, split_state
from megatron.growth.grow import grown_states
from megatron.growth.plan import pattention_entry, plan_growth
from megatron.model import TokenFormerArgs, TokenFormerModel, flops_per_token
from megatron.model import spec as model_spec
from megatron.model.init_methods import parameter_roles
from megatron.model.init_roles import InitRole
from megatron.model.spec import PattentionSpec, layer_pattentions
from tests.conftest import REPO

TINY = REPO / "tests" / "tiny.yml"
GATE = PattentionSpec("gate", "ffn_slot_num", "gate", "ffn_gate", key_init=InitRole.OUTPUT,
                      value_init=InitRole.INPUT)


def config(*overrides: str):
    return load_config([TINY], ["padded_vocab_size=256", *overrides])


def model(cfg, device: str = "cpu") -> TokenFormerModel:
    return TokenFormerModel(TokenFormerArgs.from_config(cfg), device=device)


@pytest.fixture
def with_gate(monkeypatch):
    """The spec with a fifth Pattention, `gate` (ffn_slot_num tokens) directly in each layer."""
    monkeypatch.setattr(model_spec, "LAYER_PATTENTIONS", (*model_spec.LAYER_PATTENTIONS, GATE))


def test_the_model_builds_exactly_the_declared_pattentions_split_along_the_declared_dimension():
    built = model(config(), "meta")
    for i, layer in enumerate(built.layers):
        for spec in layer_pattentions():
            pattention = layer.get_submodule(spec.path)
            assert pattention.key_param_tokens.partition_dim == spec.split_dim
    paths = {name for name, module in built.layers[0].named_modules() if hasattr(module, "key_param_tokens")}
    assert paths == {spec.path for spec in layer_pattentions()}


def test_a_declared_pattention_no_module_builds_is_refused(monkeypatch):
    nowhere = PattentionSpec("attention.inner.gate", "ffn_slot_num", "gate", "gate")
    monkeypatch.setattr(model_spec, "LAYER_PATTENTIONS", (*model_spec.LAYER_PATTENTIONS, nowhere))
    with pytest.raises(ValueError, match=r"builds the Pattentions \['attention.key', .*'mlp'\] but megatron/model/"
                                         r"spec.py declares .*'attention.inner.gate'"):
        model(config(), "meta")


def test_a_declared_pattention_is_built_and_initialised_with_its_declared_roles(with_gate):
    cfg = config()
    built = model(cfg)
    gate = built.layers[1].gate
    assert tuple(gate.key_param_tokens.shape) == (cfg.ffn_slot_num, cfg.hidden_size)
    assert int(gate.norm_token_count) == cfg.ffn_slot_num
    roles = parameter_roles(built)
    assert roles["layers.1.gate.key_param_tokens"] is InitRole.OUTPUT
    assert roles["layers.1.gate.value_param_tokens"] is InitRole.INPUT
    assert gate.key_param_tokens.std() > 0
    assert not torch.equal(gate.key_param_tokens, built.layers[1].mlp.key_param_tokens)


def test_flops_count_every_declared_pattention(monkeypatch):
    args = TokenFormerArgs.from_config(config())
    before = flops_per_token(args, False)
    monkeypatch.setattr(model_spec, "LAYER_PATTENTIONS", (*model_spec.LAYER_PATTENTIONS, GATE))
    d, n = args.hidden_size, args.ffn_slot_num
    assert flops_per_token(args, False) - before == 3 * args.num_layers * (2 * d * n + 2 * n * d)


def test_growth_grows_a_declared_pattention(with_gate):
    source_cfg = config()
    source = model(source_cfg).state_dict()
    plan = plan_growth(source_cfg, config("ffn_slot_num=512"))
    name = "layers.0.gate.key_param_tokens"
    assert pattention_entry(name) == ("ffn_slot_num", "key_param_tokens")
    assert plan.source_shape(name) == (256, 64) and plan.target_shapes[name] == (512, 64)
    grown = {n: s.weight for n, s in grown_states(source, lambda n: ParameterState(source[n]), plan)}
    assert torch.equal(grown[name][:256], source[name]) and not grown[name][256:].any()
    assert grown["layers.0.gate.value_param_tokens"].shape == (512, 64)
    assert int(grown["layers.0.gate.norm_token_count"]) == 256


def test_the_tensor_parallel_layout_splits_a_declared_pattention(with_gate):
    cfg = config()
    dims = split_dimensions(TokenFormerArgs.from_config(cfg))
    assert dims["layers.0.gate.key_param_tokens"] == 0 and dims["layers.0.gate.norm_token_count"] is None
    state = model(cfg).state_dict()
    shards = split_state(state, dims, 2)
    assert shards[1]["layers.0.gate.value_param_tokens"].shape == (128, 64)
    assert all(torch.equal(merged, state[name]) for name, merged in merge_shards(shards, dims).items())


def test_the_hugging_face_and_official_formats_carry_a_declared_pattention(with_gate):
    cfg = config()
    args = TokenFormerArgs.from_config(cfg)
    state = model(cfg).state_dict()
    counts = token_counts(state, args.num_layers)
    assert counts[0]["gate"] == cfg.ffn_slot_num
    config_json = hf_config(args, counts, None)
    assert config_json["pattention_slot_keys"]["gate"] == "ffn_slot_num"
    back = from_hf_state(to_hf_state(state), config_json, "test")
    assert set(back) == set(state) and all(torch.equal(back[name], state[name]) for name in state)
    assert official_key("layers.0.gate.key_param_tokens", args.num_layers) == "sequential.2.ffn_gate.key_param_tokens"
    official = to_official(state, args.num_layers, args.pattention_tau)
    assert "sequential.3.ffn_gate.value_param_tokens" in official
    back = from_official(official, args)
    assert set(back) == set(state) and all(torch.equal(back[name], state[name]) for name in state)


def test_a_declared_pattention_survives_loading_the_hugging_face_model(with_gate, tmp_path, monkeypatch):
    """The exported remote code builds every Pattention config.json declares, where it hard-coded the release's
    five and dropped the sixth's weights as unexpected when loading (issue 42)."""
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
            assert torch.equal(loaded[f"model.layers.{i}.gate.{leaf}"], state[f"layers.{i}.gate.{leaf}"])
    assert hf.model.layers[1].gate.norm_token_count == cfg.ffn_slot_num
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

"""The growth plan's refusals (exact messages) and the growth of single states: old rows bit-exact, zero new
keys, new values from the target-size init, zero new moments, the old √n kept, so the grown model computes
the same function (fp64, both l2 variants); shrinking undoes an untrained growth; new tokens get gradients."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpoint.parameter_state import ParameterState
from megatron.config import ConfigError, load_config
from megatron.growth.grow import grown_state, grown_states
from megatron.growth.plan import SOFTMAX_GROWTH, pattention_entry, plan_growth
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.init_methods import initial_value
from megatron.model.init_roles import InitRole
from megatron.model.pattention import Pattention
from tests.conftest import REPO

TINY = REPO / "tests" / "tiny.yml"
VOCAB = 256
DOUBLED = ("qkv_slot_num=128", "proj_slot_num=128", "ffn_slot_num=512")


def config(*overrides: str):
    return load_config([TINY], [f"padded_vocab_size={VOCAB}", *overrides])


def model_state(cfg) -> dict[str, torch.Tensor]:
    return TokenFormerModel(TokenFormerArgs.from_config(cfg)).state_dict()


def grow_model(source: dict[str, torch.Tensor], plan) -> dict[str, torch.Tensor]:
    states = grown_states(source, lambda name: ParameterState(source[name]), plan)
    return {name: state.weight for name, state in states}


def test_every_unchangeable_difference_is_reported_at_once():
    target = config("hidden_size=128", "num_layers=3", "norm_activation_type=gelu_l2_norm", *DOUBLED)
    with pytest.raises(ConfigError) as error:
        plan_growth(config(), target)
    assert str(error.value) == (
        "the target config differs from the source checkpoint's in what growth cannot change: num_layers "
        "(source 2, target 3); hidden_size (source 64, target 128); norm_activation_type (source 'l2_norm_gelu', "
        "target 'gelu_l2_norm'). Only qkv_slot_num, proj_slot_num, ffn_slot_num and the parallel layout may "
        "change: set the other keys as in the source's config.json")


def test_a_different_padded_vocabulary_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"padded vocabulary \(source 256, target 384 = .* choose a "
                                          r"make_vocab_size_divisible_by that keeps it 256"):
        plan_growth(config(), load_config([TINY], ["padded_vocab_size=384"]))


def test_shrinking_needs_allow_shrink_and_slot_counts_must_split_over_the_target_ranks():
    target = config("ffn_slot_num=128", "model_parallel_size=2", "qkv_slot_num=96")
    with pytest.raises(ConfigError) as error:
        plan_growth(config(), target, {"qkv_slot_num": 99})
    assert str(error.value) == (
        "invalid configuration:\n"
        "  - qkv_slot_num 99 is not divisible by the target's model_parallel_size 2, which splits each "
        "Pattention's tokens evenly: use a multiple of 2, e.g. 98 or 100\n"
        "  - ffn_slot_num 256 -> 128 shrinks the model; pass --allow-shrink to drop the last 128 tokens of each "
        "such Pattention (lossy: the model changes)")
    plan = plan_growth(config(), target, {"qkv_slot_num": 98}, allow_shrink=True)
    assert plan.summary() == ["qkv_slot_num 64 -> 98", "proj_slot_num 64 -> 64", "ffn_slot_num 256 -> 128"]
    assert plan.target.qkv_slot_num == 98 and plan.target.padded_vocab_size == VOCAB


def test_softmax_refuses_growth_but_re_shards():
    source = config("norm_activation_type=softmax")
    with pytest.raises(ConfigError) as error:
        plan_growth(source, config("norm_activation_type=softmax", *DOUBLED))
    assert str(error.value) == SOFTMAX_GROWTH
    assert "exp(0)" in SOFTMAX_GROWTH and "l2_norm_gelu, gelu_l2_norm" in SOFTMAX_GROWTH
    resharding = plan_growth(source, config("norm_activation_type=softmax", "model_parallel_size=2"))
    assert not (resharding.grows or resharding.shrinks)


def test_every_pattention_of_the_model_has_a_slot_key():
    model = TokenFormerModel(TokenFormerArgs.from_config(config()), device="meta")
    entries = [f"{module_name}.{leaf}" for module_name, module in model.named_modules()
               if isinstance(module, Pattention) for leaf in ("key_param_tokens", "value_param_tokens",
                                                               "norm_token_count")]
    assert len(entries) == 2 * 5 * 3
    assert all(pattention_entry(name) for name in entries)
    assert pattention_entry("layers.0.mlp.value_param_tokens") == ("ffn_slot_num", "value_param_tokens")
    assert pattention_entry("word_embeddings.weight") is None


def test_growth_keeps_old_rows_and_the_old_norm_adds_zero_keys_and_fresh_values():
    source_cfg = config()
    source = model_state(source_cfg)
    plan = plan_growth(source_cfg, config(*DOUBLED))
    name = "layers.1.attention.proj."
    moments = ParameterState(source[name + "value_param_tokens"], torch.rand(64, 64), torch.rand(64, 64))
    values = grown_state(name + "value_param_tokens", moments, plan)
    keys = grown_state(name + "key_param_tokens", ParameterState(source[name + "key_param_tokens"]), plan)
    assert torch.equal(keys.weight[:64], source[name + "key_param_tokens"]) and keys.weight.shape == (128, 64)
    assert not keys.weight[64:].any()
    assert torch.equal(values.weight[:64], source[name + "value_param_tokens"])
    fresh = initial_value(name + "value_param_tokens", (128, 64), InitRole.OUTPUT, source_cfg.seed, plan.model_args)
    assert torch.equal(values.weight[64:], fresh[64:]) and values.weight[64:].std() > 0
    for grown, old in ((values.exp_avg, moments.exp_avg), (values.exp_avg_sq, moments.exp_avg_sq)):
        assert torch.equal(grown[:64], old) and not grown[64:].any()
    assert keys.exp_avg is None
    assert grown_state(name + "norm_token_count", ParameterState(torch.tensor(64)), plan).weight.item() == 64
    word = ParameterState(source["word_embeddings.weight"])
    assert grown_state("word_embeddings.weight", word, plan) is word


def test_zero_new_values_flag():
    source_cfg = config()
    plan = plan_growth(source_cfg, config(*DOUBLED), zero_new_values=True)
    name = "layers.0.mlp.value_param_tokens"
    grown = grown_state(name, ParameterState(model_state(source_cfg)[name]), plan).weight
    assert grown.shape == (512, 64) and not grown[256:].any() and grown[:256].any()


@pytest.mark.parametrize("norm", ["l2_norm_gelu", "gelu_l2_norm"])
def test_the_grown_model_computes_the_same_function(norm):
    source_cfg = config(f"norm_activation_type={norm}")
    source = model_state(source_cfg)
    plan = plan_growth(source_cfg, config(f"norm_activation_type={norm}", *DOUBLED))
    grown = TokenFormerModel(plan.model_args).double()
    grown.load_state_dict(grow_model(source, plan))
    original = TokenFormerModel(TokenFormerArgs.from_config(source_cfg)).double()
    original.load_state_dict(source)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = original(tokens), grown(tokens)
    assert grown.layers[0].mlp.value_param_tokens.shape == (512, 64)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_shrinking_undoes_an_untrained_growth_exactly():
    source_cfg = config()
    source = model_state(source_cfg)
    grown = grow_model(source, plan_growth(source_cfg, config(*DOUBLED)))
    shrunk = grow_model(grown, plan_growth(config(*DOUBLED), source_cfg, allow_shrink=True))
    assert shrunk.keys() == source.keys()
    assert all(torch.equal(shrunk[name], source[name]) for name in source)


def test_below_the_stored_n_shrinking_normalises_with_the_new_count():
    plan = plan_growth(config(), config("ffn_slot_num=128"), allow_shrink=True)
    assert grown_state("layers.0.mlp.norm_token_count", ParameterState(torch.tensor(256)), plan).weight.item() == 128


def test_a_state_that_does_not_match_the_source_config_is_named():
    plan = plan_growth(config(), config(*DOUBLED))
    with pytest.raises(ValueError, match=r"layers.0.mlp.key_param_tokens: the source checkpoint holds shape "
                                         r"\(128, 64\), but its config.json describes \(256, 64\)"):
        grown_state("layers.0.mlp.key_param_tokens", ParameterState(torch.zeros(128, 64)), plan)
    source = model_state(config())
    del source["final_norm.bias"]
    with pytest.raises(ValueError, match=r"missing \['final_norm.bias'\], unexpected \[\]"):
        grow_model(source, plan)


@pytest.mark.parametrize("zero_new_values", [False, True])
def test_new_keys_get_gradients_unless_their_values_are_zero(zero_new_values):
    source_cfg = config()
    plan = plan_growth(source_cfg, config(*DOUBLED), zero_new_values=zero_new_values)
    grown = TokenFormerModel(plan.model_args)
    grown.load_state_dict(grow_model(model_state(source_cfg), plan))
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(grown(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    new_key_grads = [layer.mlp.key_param_tokens.grad[256:] for layer in grown.layers]
    if zero_new_values:  # zero keys with zero values never learn
        assert not any(grad.any() for grad in new_key_grads)
    else:
        assert all(grad.any() for grad in new_key_grads)
    assert not any(layer.mlp.value_param_tokens.grad[256:].any() for layer in grown.layers)


def test_the_growth_record_names_the_tokens_before_the_last_growth():
    small, large = config(), config(*DOUBLED)
    grown_from = {"qkv_slot_num": 64, "proj_slot_num": 64, "ffn_slot_num": 256}
    assert plan_growth(small, large).growth_record(None) == {"format": 1, "grown_from": grown_from}
    assert plan_growth(small, config("model_parallel_size=2")).growth_record(None) is None
    earlier = {"format": 1, "grown_from": grown_from, "frozen": grown_from, "note": "kept"}
    assert plan_growth(large, config(*DOUBLED, "model_parallel_size=2")).growth_record(earlier) == {
        "format": 1, "grown_from": grown_from, "note": "kept"}
    partly_shrunk = plan_growth(large, config("qkv_slot_num=256", "ffn_slot_num=128"), allow_shrink=True)
    assert partly_shrunk.growth_record(earlier)["grown_from"] == {
        "qkv_slot_num": 128, "proj_slot_num": 64, "ffn_slot_num": 128}


# --- growth_mode official: the official code's procedure -----------------------------------------------------


def trained_looking(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` moved off its init, so copied rows cannot pass for freshly drawn ones."""
    generator = torch.Generator().manual_seed(1)
    return {name: tensor + 0.01 * torch.randn(tensor.shape, generator=generator) if tensor.is_floating_point()
            else tensor for name, tensor in state.items()}


def official_reference(source: dict[str, torch.Tensor], target_cfg) -> dict[str, torch.Tensor]:
    """What the official code does (custom_load_fn_incremental in its megatron/checkpointing.py): a freshly
    initialised model of the target size with the same seed, each parameter-token matrix's old rows and every
    other entry copied in. Its normalisation uses the layer's token count: here the fresh model's
    norm_token_count, n'."""
    fresh = TokenFormerModel(TokenFormerArgs.from_config(target_cfg)).state_dict()
    for name, tensor in source.items():
        if name.endswith("param_tokens"):
            fresh[name][:tensor.shape[0]] = tensor
        elif not name.endswith("norm_token_count"):
            fresh[name] = tensor
    return fresh


@pytest.mark.parametrize("norm", ["l2_norm_gelu", "gelu_l2_norm", "softmax"])
def test_official_growth_equals_the_official_procedure_tensor_for_tensor(norm):
    source_cfg = config(f"norm_activation_type={norm}")
    source = trained_looking(model_state(source_cfg))
    target_cfg = config(f"norm_activation_type={norm}", *DOUBLED, "growth_mode=official")
    plan = plan_growth(source_cfg, target_cfg)
    assert (plan.mode, plan.norm, plan.optimizer, plan.resets_iteration) == ("official", "new", "reset", True)
    assert plan.target.growth_mode == "official" and not plan.keeps_function
    grown, expected = grow_model(source, plan), official_reference(source, target_cfg)
    assert grown.keys() == expected.keys()
    different = [name for name in expected if not torch.equal(grown[name], expected[name])]
    assert different == []
    assert grown["layers.0.mlp.norm_token_count"].item() == 512 and grown["layers.0.mlp.key_param_tokens"][256:].any()


def test_official_growth_changes_the_function_and_preserve_does_not():
    source_cfg = config()
    source = model_state(source_cfg)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))

    def logits(cfg, state):
        model = TokenFormerModel(TokenFormerArgs.from_config(cfg)).double()
        model.load_state_dict(state)
        with torch.no_grad():
            return model(tokens)

    expected = logits(source_cfg, source)
    for mode, same in (("preserve", True), ("official", False)):
        plan = plan_growth(source_cfg, config(*DOUBLED), mode=mode)
        assert torch.allclose(logits(plan.target, grow_model(source, plan)), expected, rtol=1e-12, atol=1e-12) == same


def test_each_factor_of_the_modes_can_be_changed_alone():
    """growth_norm_token_count and growth_optimizer (config or argument) change one factor of a mode; the mode's own
    are the defaults, and pretrain_partial_init_reset_optimizer is reset."""
    def choices(*overrides, **arguments):
        plan = plan_growth(config(), config(*DOUBLED, *overrides), **arguments)
        return plan.mode, plan.norm, plan.optimizer, plan.keeps_function, plan.describe()

    assert choices() == ("preserve", "old", "carry", True, "preserve")
    assert choices("growth_mode=official") == ("official", "new", "reset", False, "official")
    assert choices("growth_norm_token_count=new") == ("preserve", "new", "carry", False,
                                                      "preserve, √n of the new count")
    assert choices("growth_optimizer=reset") == ("preserve", "old", "reset", True, "preserve, optimizer reset")
    assert choices("pretrain_partial_init_reset_optimizer=true")[2] == "reset"
    assert choices("growth_mode=official", "growth_optimizer=carry") == (
        "official", "new", "carry", False, "official, optimizer carried over")
    assert choices("growth_mode=official", norm="old") == ("official", "old", "reset", False,
                                                           "official, √n of the old count")
    assert choices("growth_optimizer=reset", optimizer="carry")[2] == "carry"  # the tool's flag wins
    with pytest.raises(ConfigError, match="pretrain_partial_init_reset_optimizer: true and growth_optimizer: carry "
                                          "contradict each other"):
        choices("pretrain_partial_init_reset_optimizer=true", "growth_optimizer=carry")
    with pytest.raises(ConfigError, match="growth_norm_token_count 'both' is not one of old, new"):
        choices(norm="both")


def test_an_explicit_optimizer_reset_holds_when_nothing_grows():
    """A same-size warm start (pretrain_partial_init) or re-shard with a reset asked for gets a fresh optimizer, as
    the schema promises; the modes' defaults (official resets) apply only to growth."""
    def optimizer(*overrides: str) -> str:
        return plan_growth(config(), config(*overrides)).optimizer

    assert optimizer("growth_optimizer=reset") == "reset"
    assert optimizer("pretrain_partial_init_reset_optimizer=true") == "reset"
    assert optimizer() == "carry"
    assert optimizer("growth_mode=official") == "carry"


def test_new_norm_count_is_the_only_change_from_preserve_and_changes_the_function():
    """preserve with growth_norm_token_count new: the same tensors as preserve except every √n's n, which is n'."""
    source_cfg = config()
    source = trained_looking(model_state(source_cfg))
    kept = grow_model(source, plan_growth(source_cfg, config(*DOUBLED)))
    renormed = grow_model(source, plan_growth(source_cfg, config(*DOUBLED, "growth_norm_token_count=new")))
    different = sorted(name for name in kept if not torch.equal(kept[name], renormed[name]))
    assert different and all(name.endswith("norm_token_count") for name in different)
    assert renormed["layers.0.mlp.norm_token_count"].item() == 512
    assert kept["layers.0.mlp.norm_token_count"].item() == 256
    official_old = grow_model(source, plan_growth(source_cfg, config(*DOUBLED, "growth_mode=official"), norm="old"))
    assert official_old["layers.0.mlp.norm_token_count"].item() == 256


def test_official_growth_refuses_zero_new_values_and_unknown_modes():
    with pytest.raises(ConfigError, match="zero new values do not go with growth_mode official"):
        plan_growth(config(), config(*DOUBLED), zero_new_values=True, mode="official")
    with pytest.raises(ConfigError, match="growth mode 'fast' is not one of preserve, official"):
        plan_growth(config(), config(*DOUBLED), mode="fast")
    with pytest.raises(ConfigError, match="growth_mode"):
        config("growth_mode=fast")


def test_a_config_without_growth_mode_grows_by_official(tmp_path):
    """A config without growth_mode grows by official, the default (docs/growth.md says why): the tool,
    pretrain_partial_init and the progressive driver all read it from the config."""
    untouched = tmp_path / "tiny_without_growth_mode.yml"
    untouched.write_text("".join(line for line in TINY.read_text().splitlines(keepends=True)
                                 if not line.startswith("growth_mode")))
    source = load_config([untouched], [f"padded_vocab_size={VOCAB}"])
    plan = plan_growth(source, load_config([untouched], [f"padded_vocab_size={VOCAB}", *DOUBLED]))
    assert (source.growth_mode, plan.mode, plan.norm, plan.optimizer, plan.resets_iteration) == (
        "official", "official", "new", "reset", True)


def test_one_growth_mode_vocabulary_and_one_default_for_the_layer_and_the_config():
    """The modes defined once (model/args.py), the layer's grow() and the config defaulting alike; the
    schema, which cannot import the model package, keeps a literal copy pinned here."""
    import inspect

    from megatron.config.schema import SCHEMA
    from megatron.growth import plan as growth_plan
    from megatron.model.args import DEFAULT_GROWTH_MODE, GROWTH_MODES
    from megatron.model.pattention.parallel import ParallelPattention

    assert (SCHEMA["growth_mode"].choices, SCHEMA["growth_mode"].default) == (GROWTH_MODES, DEFAULT_GROWTH_MODE)
    assert growth_plan.GROWTH_MODES is GROWTH_MODES
    for layer in (Pattention, ParallelPattention):
        assert inspect.signature(layer.grow).parameters["mode"].default == DEFAULT_GROWTH_MODE, layer

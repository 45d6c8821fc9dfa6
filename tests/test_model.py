"""TokenFormerModel: shapes, causality, weight tying, layout-independent init, rotary, checkpointing, training."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.model import TokenFormerArgs, TokenFormerModel, initialize_parameters
from megatron.model.init_methods import init_function
from megatron.model.rotary import apply_rotary, rotary_cos_sin

VOCAB, SEQ = 50, 12


def tiny_args(**overrides) -> TokenFormerArgs:
    values = dict(padded_vocab_size=VOCAB, hidden_size=16, num_layers=2, num_attention_heads=2, qkv_slot_num=8,
                  proj_slot_num=8, ffn_slot_num=24, seq_length=SEQ, rotary_pct=0.5, seed=7)
    values.update(overrides)
    return TokenFormerArgs(**values)


def random_tokens(batch=2, seed=0):
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def language_model_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize("pos_emb", ["rotary", "learned", "none"])
def test_logits_have_shape_batch_seq_vocab(pos_emb):
    model = TokenFormerModel(tiny_args(pos_emb=pos_emb))
    logits = model(random_tokens(batch=3))
    assert logits.shape == (3, SEQ, VOCAB) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("pos_emb", ["rotary", "learned"])
def test_changing_token_t_changes_no_earlier_logits(pos_emb):
    model = TokenFormerModel(tiny_args(pos_emb=pos_emb)).eval()
    tokens = random_tokens()
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % VOCAB
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :6], before[:, :6], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, 6:], before[:, 6:])


def test_tied_output_uses_the_embedding_and_gradient_flows_into_one_tensor():
    model = TokenFormerModel(tiny_args())
    assert model.output_weight is model.word_embeddings.weight
    assert not any("final_linear" in name for name, _ in model.named_parameters())
    language_model_loss(model, random_tokens()).backward()
    # tokens never fed in still get gradient, through the logits
    unused = sorted(set(range(VOCAB)) - set(random_tokens()[:, :-1].flatten().tolist()))
    assert model.word_embeddings.weight.grad[unused].abs().sum() > 0


def test_untied_output_is_a_second_tensor_with_its_own_gradient():
    args = tiny_args(no_weight_tying=True)
    model = TokenFormerModel(args)
    assert model.output_weight is model.final_linear.weight
    assert not torch.equal(model.final_linear.weight, model.word_embeddings.weight)
    tied_count = sum(p.numel() for p in TokenFormerModel(tiny_args()).parameters())
    assert sum(p.numel() for p in model.parameters()) == tied_count + VOCAB * args.hidden_size
    language_model_loss(model, random_tokens()).backward()
    assert model.final_linear.weight.grad.abs().sum() > 0 and model.word_embeddings.weight.grad.abs().sum() > 0


def test_same_seed_gives_the_same_weights_whatever_the_number_of_layers_and_global_rng():
    shallow = TokenFormerModel(tiny_args(num_layers=2, output_layer_init_method="normal"))
    torch.manual_seed(999)  # the global RNG must play no part
    deep = TokenFormerModel(tiny_args(num_layers=4, output_layer_init_method="normal"))
    deep_parameters = dict(deep.named_parameters())
    for name, parameter in shallow.named_parameters():
        assert torch.equal(parameter, deep_parameters[name]), name
    assert not torch.equal(deep_parameters["layers.0.mlp.key_param_tokens"],
                           deep_parameters["layers.1.mlp.key_param_tokens"])


def test_different_seeds_give_different_weights():
    first, second = TokenFormerModel(tiny_args(seed=1)), TokenFormerModel(tiny_args(seed=2))
    assert not torch.equal(first.word_embeddings.weight, second.word_embeddings.weight)


def test_scaled_normal_scales_value_tokens_by_one_over_sqrt_two_num_layers():
    shallow, deep = TokenFormerModel(tiny_args(num_layers=2)), TokenFormerModel(tiny_args(num_layers=8))
    name = "layers.1.attention.proj"
    shallow_values = shallow.get_submodule(name).value_param_tokens
    deep_values = deep.get_submodule(name).value_param_tokens
    torch.testing.assert_close(deep_values * math.sqrt(2 * 8), shallow_values * math.sqrt(2 * 2))
    # keys use init_method (normal), which does not depend on depth
    assert torch.equal(shallow.get_submodule(name).key_param_tokens, deep.get_submodule(name).key_param_tokens)


@pytest.mark.parametrize("method, expected_std", [
    ("normal", 0.02),
    ("scaled_normal", 0.02 / math.sqrt(2 * 4)),
    ("wang_init", 2 / 4 / math.sqrt(64)),
    ("small_init", math.sqrt(2 / (5 * 64))),
    ("xavier_normal", math.sqrt(2 / (200 + 100))),
    ("xavier_uniform", math.sqrt(6 / (200 + 100)) / math.sqrt(3)),
])
def test_init_methods_have_gpt_neox_standard_deviations(method, expected_std):
    args = tiny_args(hidden_size=64, num_layers=4, num_attention_heads=4)
    tensor = torch.empty(200, 100)
    init_function(method, args)(tensor, torch.Generator().manual_seed(0))
    assert abs(tensor.std().item() / expected_std - 1) < 0.03


def test_reinitialising_with_the_same_seed_reproduces_the_weights():
    args = tiny_args(pos_emb="learned", norm="layernorm", no_weight_tying=True)
    model = TokenFormerModel(args)
    original = {name: p.clone() for name, p in model.named_parameters()}
    initialize_parameters(model, args.seed, args)
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, original[name]), name
    assert torch.equal(model.layers[0].input_layernorm.weight, torch.ones(args.hidden_size))


def test_rotary_rotates_only_the_leading_dims_of_each_head():
    rotary_dims, base = 4, 10000
    x = torch.randn(1, 1, 1, 10).expand(1, 1, 6, 10)  # the same head vector at every position
    rotated = apply_rotary(x, *rotary_cos_sin(6, rotary_dims, base, x.device))
    assert torch.equal(rotated[..., rotary_dims:], x[..., rotary_dims:])
    assert not torch.allclose(rotated[..., 3, :rotary_dims], rotated[..., 4, :rotary_dims])
    half = rotary_dims // 2
    for position in range(6):  # GPT-NeoX rotate-half: pairs (i, i + half) rotated by position·θ_i
        for i in range(half):
            angle = position / base ** (2 * i / rotary_dims)
            first, second = x[0, 0, position, i], x[0, 0, position, i + half]
            expected = (first * math.cos(angle) - second * math.sin(angle),
                        second * math.cos(angle) + first * math.sin(angle))
            actual = (rotated[0, 0, position, i], rotated[0, 0, position, i + half])
            torch.testing.assert_close(torch.stack(actual), torch.stack(expected))


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    results = []
    for checkpointing in (False, True):
        args = tiny_args(num_layers=3, checkpoint_activations=checkpointing, checkpoint_num_layers=2,
                         hidden_dropout=0.1, attention_dropout=0.1)
        model = TokenFormerModel(args).train()
        torch.manual_seed(3)  # the same dropout masks; checkpointing must replay them on recompute
        loss = language_model_loss(model, random_tokens())
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_plain, grads_plain), (loss_checkpointed, grads_checkpointed) = results
    torch.testing.assert_close(loss_checkpointed, loss_plain, rtol=0, atol=0)
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_checkpointed[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_one_optimizer_step_lowers_the_loss_on_a_repeated_batch():
    model = TokenFormerModel(tiny_args())
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens = random_tokens(batch=4)
    loss_before = language_model_loss(model, tokens)
    loss_before.backward()
    optimizer.step()
    with torch.no_grad():
        assert language_model_loss(model, tokens) < loss_before.detach()


def test_model_constructs_and_runs_on_the_meta_device():
    args = tiny_args(hidden_size=768, num_attention_heads=12, num_layers=12, qkv_slot_num=768, proj_slot_num=768,
                     ffn_slot_num=3072, padded_vocab_size=50304)
    model = TokenFormerModel(args, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model(torch.zeros(1, SEQ, dtype=torch.long, device="meta")).shape == (1, SEQ, 50304)


def test_state_dict_uses_the_official_names():
    model = TokenFormerModel(tiny_args())
    state = model.state_dict()
    for part in ("attention.query", "attention.key", "attention.value", "attention.proj", "mlp"):
        assert f"layers.1.{part}.key_param_tokens" in state and f"layers.1.{part}.value_param_tokens" in state
    assert state["layers.0.mlp.norm_token_count"].item() == 24
    assert state["layers.0.attention.proj.norm_token_count"].item() == 8
    assert not any("layernorm" in name for name in state)  # non-parametric block norms have no state
    assert {"word_embeddings.weight", "final_norm.weight", "final_norm.bias"} <= set(state)


def test_from_config_reads_same_named_attributes_and_names_missing_ones():
    reference = tiny_args(pattention_tau=0.5)
    cfg = SimpleNamespace(**dataclasses.asdict(reference), unrelated_key=1)
    assert TokenFormerArgs.from_config(cfg) == reference
    assert TokenFormerArgs.from_config(cfg, padded_vocab_size=64).padded_vocab_size == 64
    del cfg.qkv_slot_num
    with pytest.raises(ValueError, match="qkv_slot_num"):
        TokenFormerArgs.from_config(cfg)


@pytest.mark.parametrize("overrides, key", [
    (dict(num_attention_heads=3), "num_attention_heads"),
    (dict(pos_emb="alibi"), "pos_emb"),
    (dict(rotary_pct=0.1), "rotary_pct"),
    (dict(padded_vocab_size=None), "padded_vocab_size"),
    (dict(norm_activation_type="relu"), "norm_activation_type"),
    (dict(init_method="orthogonal"), "init_method"),
    (dict(pos_emb="learned", max_position_embeddings=SEQ - 1), "max_position_embeddings"),
])
def test_bad_arguments_get_one_error_naming_the_key(overrides, key):
    with pytest.raises(ValueError, match=key):
        tiny_args(**overrides)


def test_learned_positions_reject_sequences_longer_than_the_table():
    model = TokenFormerModel(tiny_args(pos_emb="learned", seq_length=SEQ - 1))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(random_tokens())


def test_bf16_model_runs_and_stays_close_to_fp32():
    model = TokenFormerModel(tiny_args())
    tokens = random_tokens()
    expected = model(tokens)
    logits = model.to(torch.bfloat16)(tokens)
    assert logits.dtype == torch.bfloat16
    assert model.layers[0].mlp.norm_token_count.dtype == torch.int64
    assert (logits.float() - expected).norm() / expected.norm() < 5e-2

"""The dense Transformer baseline (`model_type: transformer`, megatron/model/dense.py): GPT-NeoX's layer in the
same model and trainer. Tensor and pipeline parallelism are checked with TokenFormer's cases
(tests/test_tensor_parallel_model.py, tests/test_pipeline_model.py); deepy.py trains, saves and resumes it
bitwise in tests/test_dense_training.py."""

from __future__ import annotations

import pytest
import torch

from megatron.config import Config, ConfigError
from megatron.growth.plan import plan_growth
from megatron.model import TokenFormerArgs, TokenFormerModel, flops_per_token
from megatron.model.parameter_count import count_parameters_by_component
from megatron.training.step import lm_loss


def dense_args(**overrides) -> TokenFormerArgs:
    values = dict(padded_vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, qkv_slot_num=None,
                  proj_slot_num=None, ffn_slot_num=None, seq_length=16, model_type="transformer", rotary_pct=0.25,
                  pattention_impl="fused", seed=3)
    values.update(overrides)
    return TokenFormerArgs(**values)


def test_gpt_neox_layer_names_shapes_count_and_init():
    args = dense_args()
    model = TokenFormerModel(args)
    d, layer = 32, dict(model.layers[0].named_parameters())
    assert {name: tuple(p.shape) for name, p in layer.items()} == {
        "attention.query_key_value.weight": (3 * d, d), "attention.query_key_value.bias": (3 * d,),
        "attention.dense.weight": (d, d), "attention.dense.bias": (d,),
        "mlp.dense_h_to_4h.weight": (4 * d, d), "mlp.dense_h_to_4h.bias": (4 * d,),
        "mlp.dense_4h_to_h.weight": (d, 4 * d), "mlp.dense_4h_to_h.bias": (d,)}
    counts = count_parameters_by_component(model)
    assert counts["attention"] + counts["ffn"] == 2 * (12 * d * d + 9 * d)  # weights, then biases 3d+d+4d+d
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in layer.items() if n.endswith("bias"))
    # GPT-NeoX's init: input layers N(0, 0.02), output layers scaled by 1/√(2·layers)
    assert abs(layer["mlp.dense_h_to_4h.weight"].std().item() - 0.02) < 0.002
    assert abs(layer["mlp.dense_4h_to_h.weight"].std().item() - 0.02 / 2) < 0.001
    # 24·d² per layer and token forward, the attention's 4·s·d and the logits' 2·d·V; training is 3 × forward
    assert flops_per_token(args, include_recompute=False) == 3 * (2 * (24 * d * d + 4 * 16 * d) + 2 * d * 64)


def test_heads_take_gpt_neox_per_head_q_k_v_layout():
    """query_key_value's output is [heads, (q, k, v), head_dim] per token, as GPT-NeoX lays it out: zeroing the
    value rows of one head changes only that head's share of the context."""
    model = TokenFormerModel(dense_args(rotary_pct=1.0)).eval()
    attention = model.layers[0].attention
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    captured = {}
    attention.dense.register_forward_hook(lambda module, inputs, output: captured.update(context=inputs[0]))
    attention(x)
    before = captured["context"].clone()
    head_dim = 8
    with torch.no_grad():  # head 2's values: rows [2·3·hd + 2·hd, 2·3·hd + 3·hd)
        attention.query_key_value.weight[2 * 3 * head_dim + 2 * head_dim:2 * 3 * head_dim + 3 * head_dim] = 0
    attention(x)
    changed = (captured["context"] - before).abs().amax(dim=(0, 1)).view(4, head_dim).amax(-1) > 0
    assert changed.tolist() == [False, False, True, False]


def test_it_learns_a_sequence():
    model = TokenFormerModel(dense_args())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(40):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, train_iters=1,
              optimizer={"type": "Adam", "params": {"lr": 1e-3}}, train_micro_batch_size_per_gpu=1)


def test_a_dense_config_needs_no_slot_counts_and_a_tokenformer_still_does():
    cfg = Config.from_dict({**CONFIG, "model_type": "transformer"})
    assert cfg.qkv_slot_num is None and TokenFormerArgs.from_config(cfg, padded_vocab_size=64).model_type == \
        "transformer"
    with pytest.raises(ConfigError, match="qkv_slot_num is required"):
        Config.from_dict(CONFIG)
    with pytest.raises(ConfigError, match="model_type"):
        Config.from_dict({**CONFIG, "model_type": "mamba"})


def test_growth_refuses_a_dense_model():
    source = Config.from_dict({**CONFIG, "model_type": "transformer"})
    target = Config.from_dict({**CONFIG, "qkv_slot_num": 8, "proj_slot_num": 8, "ffn_slot_num": 16})
    with pytest.raises(ConfigError, match="the checkpoint's config has model_type transformer, which has none"):
        plan_growth(source, target)

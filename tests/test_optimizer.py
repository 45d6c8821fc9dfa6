"""Weight-decay groups and the DeepSpeed config derived from ours."""

import torch

from megatron.config import Config
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.training.optimizer import build_optimizer, deepspeed_config, parameter_groups
from tests.test_config import MINIMAL


def tiny_model() -> TokenFormerModel:
    return TokenFormerModel(
        TokenFormerArgs(padded_vocab_size=64, hidden_size=16, num_layers=1, num_attention_heads=2,
                        qkv_slot_num=8, proj_slot_num=8, ffn_slot_num=16, seq_length=8)
    )


def test_decay_on_tokens_and_embeddings_not_on_norms():
    model = tiny_model()
    decay, no_decay = parameter_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert any(n.endswith("key_param_tokens") for n in decayed)
    assert any(n.endswith("value_param_tokens") for n in decayed)
    assert any("embed" in n for n in decayed)
    assert {names[id(p)] for p in no_decay["params"]} == {n for n, p in model.named_parameters() if p.ndim < 2}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_decay_really_skips_norms_in_an_update():
    model = tiny_model()
    cfg = Config.from_dict({**MINIMAL, "weight_decay": 0.5})
    optimizer = build_optimizer(model, cfg, "cpu")
    norm_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.ndim < 2}
    tokens_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.ndim >= 2}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # only weight decay moves parameters
    optimizer.step()
    assert all(torch.equal(p, norm_before[n]) for n, p in model.named_parameters() if p.ndim < 2)
    assert all(not torch.equal(p, tokens_before[n]) for n, p in model.named_parameters() if p.ndim >= 2)


def test_deepspeed_config_carries_batch_clipping_zero_and_precision():
    cfg = Config.from_dict(
        {**MINIMAL, "gradient_accumulation_steps": 3, "gradient_clipping": 0.5,
         "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
        world_size=2,
    )
    ds = deepspeed_config(cfg)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        12, 2, 3)
    assert ds["gradient_clipping"] == 0.5 and ds["zero_optimization"]["stage"] == 2
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
    assert ds["timers"] == {"throughput": {"enabled": False}}  # its device syncs: two a step

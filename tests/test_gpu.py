"""The `gpu` tier (`make test-gpu`): the model on a CUDA device computes what it computes on the CPU.
Skipped, with the reason, where torch sees no CUDA device (tests/conftest.py)."""

import pytest
import torch
import torch.nn.functional as F

from megatron.model import TokenFormerArgs, TokenFormerModel

pytestmark = pytest.mark.gpu

VOCAB, SEQ = 512, 64


def model_and_tokens(norm_activation_type: str) -> tuple[TokenFormerModel, torch.Tensor]:
    args = TokenFormerArgs(padded_vocab_size=VOCAB, hidden_size=128, num_layers=2, num_attention_heads=4,
                           qkv_slot_num=128, proj_slot_num=128, ffn_slot_num=512, seq_length=SEQ, rotary_pct=0.25,
                           norm_activation_type=norm_activation_type, seed=3)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return TokenFormerModel(args), tokens


def loss_and_gradients(model: TokenFormerModel, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("norm_activation_type", ["l2_norm_gelu", "gelu_l2_norm", "softmax"])
def test_cuda_fp32_loss_and_gradients_equal_the_cpu(norm_activation_type):
    model, tokens = model_and_tokens(norm_activation_type)
    cpu_loss, cpu_grads = loss_and_gradients(model, tokens)
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda_loss, cuda_grads = loss_and_gradients(model.cuda(), tokens.cuda())
    torch.testing.assert_close(cuda_loss, cpu_loss, rtol=1e-5, atol=1e-6)
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(cuda_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_cuda_bf16_loss_is_the_fp32_loss_to_bf16_precision():
    model, tokens = model_and_tokens("l2_norm_gelu")
    reference, _ = loss_and_gradients(model.cuda(), tokens.cuda())
    bf16_loss, grads = loss_and_gradients(model.to(torch.bfloat16), tokens.cuda())
    assert abs(bf16_loss.item() - reference.item()) < 2e-2 * reference.item()
    assert all(torch.isfinite(g).all() for g in grads.values())

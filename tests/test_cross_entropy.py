"""mpu.vocab_parallel_cross_entropy on one rank: the loss and the gradient of the formula autograd differentiates
(log Σ exp(l − m) − (l_label − m), in fp32), bit for bit where its blocks of rows hold many rows, whether the
logits come in one block or several; and what it keeps for backward: the logits and [tokens] statistics, never
an fp32 [tokens, vocabulary] tensor. The tensor-parallel split is tests/test_mpu_layers.py's (2 and 4 ranks)."""

from __future__ import annotations

import pytest
import torch

from megatron.mpu import cross_entropy
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy


def formula(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The per-token loss written out, for autograd to differentiate (one rank: the whole vocabulary)."""
    logits = logits.float()
    shifted = logits - logits.detach().amax(dim=-1, keepdim=True)
    return shifted.exp().sum(dim=-1).log() - shifted.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def loss_and_gradient(function, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.clone().requires_grad_()
    loss = function(leaf, labels)
    loss.mean().backward()
    return loss.detach(), leaf.grad


def inputs(dtype: torch.dtype, vocab: int = 1000, batch: int = 4, sequence: int = 96):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, sequence, vocab, generator=generator) * 4).to(dtype)
    return logits, torch.randint(0, vocab, (batch, sequence), generator=generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_block", [None, 128, 100])  # one block; 3 blocks; 4 with a ragged last one
def test_loss_and_gradient_are_the_formulas_bit_for_bit(monkeypatch, dtype, rows_per_block):
    logits, labels = inputs(dtype)
    if rows_per_block is not None:
        monkeypatch.setattr(cross_entropy, "BLOCK_BYTES", rows_per_block * 4 * logits.shape[-1])
        assert len(cross_entropy._row_blocks(logits.numel() // logits.shape[-1], logits.shape[-1])) > 1
    want_loss, want_grad = loss_and_gradient(formula, logits, labels)
    loss, grad = loss_and_gradient(vocab_parallel_cross_entropy, logits, labels)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert torch.equal(loss, want_loss)
    assert torch.equal(grad, want_grad)


def test_blocks_of_a_single_row_agree_to_rounding(monkeypatch):
    logits, labels = inputs(torch.float32, vocab=4096, sequence=8)
    monkeypatch.setattr(cross_entropy, "BLOCK_BYTES", 1)
    want_loss, want_grad = loss_and_gradient(formula, logits, labels)
    loss, grad = loss_and_gradient(vocab_parallel_cross_entropy, logits, labels)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-9)


def saved_bytes(function, logits: torch.Tensor, labels: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward from `function`, the logits themselves not counted."""
    leaf = logits.clone().requires_grad_()
    kept: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function(leaf, labels)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept
                if t.untyped_storage().data_ptr() != leaf.untyped_storage().data_ptr()}
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_keeps_token_statistics_not_an_fp32_copy_of_the_logits(dtype):
    logits, labels = inputs(dtype, vocab=2048)
    tokens = labels.numel()
    kept = saved_bytes(vocab_parallel_cross_entropy, logits, labels)
    assert kept <= 32 * tokens  # row max, Σ exp, label index and mask: [tokens] each
    assert saved_bytes(formula, logits, labels) >= 4 * logits.numel()  # the formula keeps exp(l − m) in fp32

"""Cross-entropy of vocabulary-split logits, without gathering the full vocabulary on any rank and without an
fp32 copy of the whole logits.

Per token, with this rank's logits block l [..., V/t] and m the row max over every rank's block:

    loss = log Σ_v exp(l_v − m) − (l_label − m)        (in at least fp32 whatever the logits' dtype)
    dl   = exp(l − m) · (g / Σ) − g · [v = label]       (g: the loss's incoming gradient)

The row max, the blocks' sums of exponentials and the label's logit (non-zero only on the rank whose block holds
the label) are combined by all-reduces of [tokens]-sized tensors; the loss is then replicated, so its gradient
reaches each block unchanged. The logits are upcast to fp32 a block of rows at a time (BLOCK_BYTES of fp32), in
forward and again in backward, which recomputes exp(l − m) instead of keeping it: what the loss holds for
backward is the logits it was given and fp32 [tokens] statistics, where autograd through the formula would keep
an fp32 copy of the exponentials and make three more while it runs (each 4 bytes × tokens × vocabulary: 3.3 GB
at 16k tokens of a 50k vocabulary).
Each row's arithmetic is the formula's, operation for operation, so the loss and the gradient are autograd's
through it: bit for bit in fp32 on a CPU where a block holds many rows (a sum kernel may order the additions of
a block of a single row differently), tests/test_cross_entropy.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron.mpu.mappings import all_reduce_max, all_reduce_sum
from megatron.mpu.sharding import block_start

BLOCK_BYTES = 256 * 2**20


def _row_blocks(rows: int, width: int) -> list[slice]:
    per_block = max(1, BLOCK_BYTES // (4 * width))
    return [slice(start, min(start + per_block, rows)) for start in range(0, rows, per_block)]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor) -> Tensor:
        width = logits.shape[-1]
        flat = logits.reshape(-1, width)
        local = (labels - block_start(width)).reshape(-1)
        outside = (local < 0) | (local >= width)
        local = local.masked_fill(outside, 0).unsqueeze(-1)
        row_max = all_reduce_max(flat.amax(dim=-1).float())
        statistics = torch.empty(2, len(flat), dtype=torch.float32, device=logits.device)  # Σ exp, label logit
        for rows in _row_blocks(len(flat), width):
            shifted = flat[rows] - row_max[rows].unsqueeze(-1)  # fp32: a bf16 logit is widened exactly first
            statistics[1, rows] = shifted.gather(-1, local[rows]).squeeze(-1)
            statistics[0, rows] = shifted.exp_().sum(dim=-1)
            del shifted
        statistics[1].masked_fill_(outside, 0.0)
        sum_exp, label_logit = all_reduce_sum(statistics)
        ctx.save_for_backward(logits, row_max, sum_exp, local, outside)
        return (sum_exp.log() - label_logit).view(labels.shape)

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, None]:
        logits, row_max, sum_exp, local, outside = ctx.saved_tensors
        width = logits.shape[-1]
        flat = logits.reshape(-1, width)
        grad = grad_loss.reshape(-1)
        exp_scale = (grad / sum_exp).unsqueeze(-1)
        label_grad = (-grad).masked_fill(outside, 0.0).unsqueeze(-1)
        grad_logits = torch.empty_like(flat)
        for rows in _row_blocks(len(flat), width):
            # fp32 logits: the gradient is computed in its own rows; narrower ones go through an fp32 block
            block = grad_logits[rows] if flat.dtype == torch.float32 else None
            block = torch.sub(flat[rows], row_max[rows].unsqueeze(-1), out=block)
            block.exp_().mul_(exp_scale[rows]).scatter_add_(-1, local[rows], label_grad[rows])
            if flat.dtype != torch.float32:
                grad_logits[rows] = block
            del block
        return grad_logits.view(logits.shape), None


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token loss log Σ_v exp(l_v) − l_label [...], in fp32, from this rank's logits block [..., V/t]."""
    return _VocabParallelCrossEntropy.apply(logits, labels)

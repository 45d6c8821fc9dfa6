"""Cross-entropy of vocabulary-split logits, without gathering the full vocabulary on any rank."""

from __future__ import annotations

from torch import Tensor

from megatron.mpu.mappings import all_reduce_max, reduce_from_region
from megatron.mpu.sharding import block_start


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token loss log Σ_v exp(l_v) − l_label [...], in fp32, from this rank's logits block [..., V/t].

    The row max (for stability), the blocks' sums of exponentials and the label's logit (non-zero only on
    the rank whose block holds the label) are combined by all-reduces of [tokens]-sized tensors. The loss
    is then replicated, so its gradient reaches each block unchanged (reduce_from_region).
    """
    logits = logits.float()
    shifted = logits - all_reduce_max(logits.detach().amax(dim=-1, keepdim=True))
    sum_exp = reduce_from_region(shifted.exp().sum(dim=-1))
    local_labels = labels - block_start(logits.shape[-1])
    outside = (local_labels < 0) | (local_labels >= logits.shape[-1])
    label_logit = shifted.gather(-1, local_labels.masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1)
    label_logit = reduce_from_region(label_logit.masked_fill(outside, 0.0))
    return sum_exp.log() - label_logit

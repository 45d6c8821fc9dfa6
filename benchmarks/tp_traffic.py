"""Tensor-parallel bytes per layer per token: the formulas of docs/tensor_parallel.md.

Each of t ranks sends, per layer and token, forward + backward, with activations of e bytes per element
(row statistics are always fp32) and the ring algorithm's (t−1)/t factors:
    TokenFormer:  (t−1)/t · (16·d·e + 80)   bytes, softmax + (t−1)/t · 40 (its row max, all-reduced too)
    Megatron:     (t−1)/t · 8·d·e           bytes (two all-reduces of d forward, two backward)
benchmarks/tp_comm.py measures the first on real ranks; the second is the transformer reference.
"""

_STATISTIC_BYTES = 4


def tokenformer_bytes_per_token(hidden_size: int, tensor_size: int, element_size: int, norm_type: str) -> float:
    """Bytes each rank sends per TokenFormer layer per token, forward + backward."""
    # Activations: 3d reduce-scattered + d all-gathered + 2d all-reduced (counted twice by the ring) each way.
    # Statistics: one fp32 row sum per Pattention each way (5 + 5), softmax's 5 row maxes forward.
    statistics = 10 + (5 if norm_type == "softmax" else 0)
    return (tensor_size - 1) / tensor_size * (16 * hidden_size * element_size + 2 * statistics * _STATISTIC_BYTES)


def megatron_bytes_per_token(hidden_size: int, tensor_size: int, element_size: int) -> float:
    """Bytes each rank sends per Megatron transformer layer per token, forward + backward."""
    return (tensor_size - 1) / tensor_size * 8 * hidden_size * element_size

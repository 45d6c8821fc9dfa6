"""Training FLOPs per token of a TokenFormer: the one formula the training log and benchmarks share.

Forward, per token (a multiply-add counts as 2 FLOPs; element-wise ops, norms and Θ are ignored):
    Pattention d_in -> d_out with n tokens:  2·d_in·n (X·K_Pᵀ) + 2·n·d_out (Θ(·)·V_P)
    per layer:  its Pattentions (spec.py: Q, K, V, proj, FFN), all d -> d,
                (the dense Transformer, model_type transformer: its linear layers, 2·(3d² + d² + 2·4d²) = 24·d²)
                + attention 2·2·s·d (scores Q·Kᵀ and context A·V; causal counted in full, as Megatron does)
    logits:     2·d·V
Training = 3 × forward (backward ≈ 2 × forward). Activation checkpointing recomputes the layers' forward
once more during backward (the logits are not recomputed), added when `include_recompute` is true.
"""

from megatron.model.args import TokenFormerArgs
from megatron.model.spec import layer_pattentions


def _pattention_flops(input_dim: int, output_dim: int, num_tokens: int) -> int:
    return 2 * input_dim * num_tokens + 2 * num_tokens * output_dim


def layer_pattention_flops_per_token(args: TokenFormerArgs) -> int:
    """Forward FLOPs of one block's Pattention layers per token: the part parameter tokens scale (the dense
    Transformer: its linear layers)."""
    d = args.hidden_size
    if args.model_type == "transformer":
        return 2 * (3 * d * d + d * d + 2 * 4 * d * d)
    return sum(_pattention_flops(d, d, getattr(args, spec.slot_key)) for spec in layer_pattentions())


def layer_forward_flops_per_token(args: TokenFormerArgs) -> int:
    """Forward FLOPs of one TokenFormer block per token."""
    return layer_pattention_flops_per_token(args) + 2 * 2 * args.seq_length * args.hidden_size


def _logits_forward_flops_per_token(args: TokenFormerArgs) -> int:
    return 2 * args.hidden_size * args.padded_vocab_size


def pattention_share(args: TokenFormerArgs) -> float:
    """The Pattention layers' share of the forward FLOPs per token: how much of the cost growth scales."""
    forward = args.num_layers * layer_forward_flops_per_token(args) + _logits_forward_flops_per_token(args)
    return args.num_layers * layer_pattention_flops_per_token(args) / forward


def flops_per_token(args: TokenFormerArgs, include_recompute: bool) -> int:
    """Training (forward + backward) FLOPs per token; see the module docstring for the formula."""
    layers_forward = args.num_layers * layer_forward_flops_per_token(args)
    logits_forward = _logits_forward_flops_per_token(args)
    recompute = layers_forward if include_recompute else 0
    return 3 * (layers_forward + logits_forward) + recompute

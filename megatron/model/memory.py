"""Bytes of a TokenFormer training step by formula: what autograd saves for backward, per implementation
(`plain`, `fused`, `flash`), the model states under ZeRO, and the micro-batch that fits a device.

Why a formula: what a micro-batch costs decides the batch a GPU can run, and the formula says where the
bytes go and how they scale with d, n, the heads and the vocabulary, for configs too large to build here.
pattention_impl: auto reads it to choose fused or flash (megatron/training/pattention_choice.py);
benchmarks/memory_model.py checks it against the storages a real forward saves (tests/test_memory_model.py
does the same on a tiny model for every implementation, Θ, dtype and option, so a wrong term fails).

Notation: e bytes per activation element (2 bf16/fp16, 4 fp32); z bytes of a layer norm's mean and rstd (e on
the CPU; 4 on CUDA, which keeps them in fp32); d hidden size, h heads, V padded vocabulary, r rotary dims of
a head; a Pattention has n parameter tokens (n_qkv for Q, K, V; n_proj; n_ffn) and outputs d wide.

    per layer and token, all implementations      10·e·d + 4·z + 4·h
        the two norms' inputs (2·e·d) and statistics (4·z); their outputs, the inputs of Q/K/V and of the FFN
        (2·e·d); attention: rotated Q and K (2·e·d, one tensor; none without rotary), the Q/K/V output (3·e·d,
        kept whole by V, a view of it), SDPA's output (e·d; proj's input too, the head merge being a view) and
        its log-sum-exp (4·h)
    + per Pattention (those megatron/model/spec.py declares: Q, K, V, proj, FFN)
        plain   l2_norm_gelu (c+1)·4·n + e·n + 12    gelu_l2_norm (c+2)·4·n + e·n + 12    softmax 8·n + e·n + 4
                (fp32 [tokens, n] tensors autograd keeps: the scores, c times (2 when e < 4: each fp32 upcast
                is a copy; 1 in fp32), GeLU's input and output or exp's; the weights in e; fp32 row statistics)
        fused   e·n + 8                      (the kept score matrix, fp32 statistic and row factor)
        flash   8, softmax 12                (the fp32 statistic and row factor, softmax's row max: nothing
                                              [tokens, ·] wide)
    + e·d with τ ≠ 1 for fused and flash: they keep proj's input scaled by τ, a copy of SDPA's output
    per layer and sequence position: 4·r (rotary cos and sin, fp32, shared by the micro-batch's sequences);
    per layer: 4 per Pattention (its token count n)
    + hidden dropout (hidden_dropout > 0): its mask, m·d per token at each of the layer's two sites (m = e on
      the CPU, which multiplies by a mask of the input's dtype; 1 on CUDA, whose fused dropout keeps a bool mask)
    model, per token: 2·e·d + 2·z + e·V + 30 (embedding ids and mask; the final norm's input and statistics;
        the logits GEMM's input; the loss (megatron/mpu/cross_entropy.py): the logits, their fp32 row max,
        Σexp and label logit, the label index and mask); per position 8 with learned positions; m·d with hidden
        dropout (the embedding's)
    activation checkpointing (groups of k layers): e·d per token for each group's input instead of the layers

So flash's bytes do not depend on n, plain's and fused's grow with it: a flash Pattention keeps its input and
two or three fp32 numbers per token, where fused keeps e·n bytes more.

Largest micro-batch (sequences of seq_length on one GPU), ZeRO-1 over D data-parallel ranks (default 8):
    model states  2·P (bf16 parameters) + 2·P (bf16 gradients), replicated, + 12·P / D (fp32 master
                  weights, Adam m and v, sharded)
    activations   without checkpointing: every layer's saved bytes + the model's + the loss's transients (in
                  its backward, beside the logits it keeps: their gradient, e·V per token, and one block of rows
                  in fp32, at most cross_entropy.BLOCK_BYTES); with checkpointing: the groups' inputs + one
                  group's saved bytes (recomputed during its backward) + the model's + the loss's transients
    budget        (1 − reserve) · GPU memory − model states; the reserve (default 10 %) is left for the
                  allocator's fragmentation, kernel workspaces, DeepSpeed's communication buckets and the
                  backward's transient buffers (one Pattention's at a time: fused at most two [tokens, n] fp32
                  buffers; flash's Triton kernels (flash_backend: kernels) nothing of n, its blocks (flash.py) a few
                  [rows, n] ones, rows = max(MIN_ROWS, tokens / BLOCKS); the activations' gradients), which the
                  formula leaves out.
The GPU figures take z = 4 and assume SDPA's flash or memory-efficient kernel (fp32 log-sum-exp, output laid
out [b, s, heads, head_dim], as on the CPU); tensor parallelism 1. Attention dropout is not covered (the paper
configs have none): on the CPU, SDPA then takes its math path, whose [b, heads, s, s] tensors the formula does not
count; saved_bytes raises NotModelled, and the callers say what they do without the estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.model.args import NORM_ACTIVATIONS, PATTENTION_IMPLS, TokenFormerArgs
from megatron.model.parameter_count import count_parameters_by_component
from megatron.model.spec import layer_pattentions
from megatron.model.tokenformer import TokenFormerModel
from megatron.mpu.cross_entropy import BLOCK_BYTES

FP32 = 4
GIB = 2**30


class NotModelled(ValueError):
    """The run has something the formula does not count (attention dropout): no estimate."""


def element_bytes(dtype: torch.dtype) -> int:
    """e: bytes of one activation element; the formula covers 2-byte and 4-byte floats."""
    size = torch.empty((), dtype=dtype).element_size()
    if not dtype.is_floating_point or size not in (2, 4):
        raise ValueError(f"dtype {dtype}: the memory model covers bf16, fp16 and fp32 activations")
    return size


def pattention_bytes_per_token(impl: str, norm_type: str, n: int, e: int) -> int:
    """Bytes one Pattention of n tokens saves per input token besides its input (module docstring)."""
    if impl == "plain":
        copies = 1 if e >= FP32 else 2
        if norm_type == "l2_norm_gelu":
            return (copies + 1) * FP32 * n + e * n + 3 * FP32
        if norm_type == "gelu_l2_norm":
            return (copies + 2) * FP32 * n + e * n + 3 * FP32
        return 2 * FP32 * n + e * n + FP32
    if impl == "fused":
        return e * n + 2 * FP32
    if impl == "flash":
        return 3 * FP32 if norm_type == "softmax" else 2 * FP32
    raise ValueError(f"pattention_impl={impl!r}: must be one of {PATTENTION_IMPLS}")


@dataclass(frozen=True)
class SavedBytes:
    """What one training forward saves for backward, by how it scales (bytes)."""

    layer_per_token: int
    layer_per_position: int
    layer_fixed: int
    model_per_token: int
    model_per_position: int
    checkpoint_input_per_token: int  # a checkpointed group's input [tokens, d]

    def layer(self, batch: int, seq: int) -> int:
        """One layer's saved bytes for `batch` sequences of `seq` tokens."""
        return self.layer_per_token * batch * seq + self.layer_per_position * seq + self.layer_fixed

    def total(self, layers: int, batch: int, seq: int, checkpoint_group: int | None = None) -> int:
        """The whole model's; with a checkpoint group size, what checkpointing keeps until backward."""
        model = self.model_per_token * batch * seq + self.model_per_position * seq
        if checkpoint_group is None:
            return layers * self.layer(batch, seq) + model
        return math.ceil(layers / checkpoint_group) * self.checkpoint_input_per_token * batch * seq + model


def saved_bytes(args: TokenFormerArgs, impl: str, dtype: torch.dtype, device: str = "cpu") -> SavedBytes:
    """The formula of the module docstring for `args` run by `impl` in `dtype` on `device` ("cpu"/"cuda")."""
    if impl not in PATTENTION_IMPLS:
        raise ValueError(f"pattention_impl={impl!r}: must be one of {PATTENTION_IMPLS}")
    if args.attention_dropout:
        raise NotModelled("the memory model covers no attention dropout (the paper configs have none)")
    if args.norm_activation_type not in NORM_ACTIVATIONS:
        raise ValueError(f"norm_activation_type={args.norm_activation_type!r}")
    e, d, h, vocab = element_bytes(dtype), args.hidden_size, args.num_attention_heads, args.padded_vocab_size
    z = e if device == "cpu" else max(e, FP32)
    # one hidden dropout site's mask per token: the CPU's in the input's dtype, CUDA's fused dropout's bool
    mask_element = e if device == "cpu" else 1
    mask = mask_element * d if args.hidden_dropout else 0
    norms = 2 * (e * d + 2 * z)
    # fused and flash keep τ·x, a new tensor when τ ≠ 1: for Q/K/V and the FFN in place of the norm's output,
    # for proj besides SDPA's output, which attention keeps anyway
    scaled_proj_input = e * d if impl != "plain" and args.pattention_tau != 1.0 else 0
    pattention_inputs = 2 * e * d + scaled_proj_input
    rotated = 2 * e * d if args.rotary_dims else 0  # without rotary, Q and K are views of the Q/K/V output
    attention = rotated + 3 * e * d + e * d + FP32 * h

    def pattention(n: int) -> int:
        return pattention_bytes_per_token(impl, args.norm_activation_type, n, e)

    pattentions = sum(pattention(getattr(args, spec.slot_key)) for spec in layer_pattentions())
    embedding = 8 + 1
    final_norm = e * d + 2 * z
    logits_input = e * d
    loss = e * vocab + 3 * FP32 + 8 + 1
    return SavedBytes(
        layer_per_token=norms + pattention_inputs + attention + pattentions + 2 * mask,
        layer_per_position=2 * FP32 * (args.rotary_dims // 2),
        layer_fixed=FP32 * len(layer_pattentions()),  # each Pattention's n
        model_per_token=embedding + final_norm + logits_input + loss + mask,
        model_per_position=8 if args.pos_emb == "learned" else 0,
        checkpoint_input_per_token=e * d,
    )


def loss_transient_bytes(args: TokenFormerArgs, dtype: torch.dtype, tokens: int) -> int:
    """Bytes alive at the loss's backward besides what it saves: the logits' gradient and one block of its rows
    in fp32 (megatron/mpu/cross_entropy.py)."""
    width = FP32 * args.padded_vocab_size
    return element_bytes(dtype) * args.padded_vocab_size * tokens + width * min(tokens, max(1, BLOCK_BYTES // width))


def peak_activation_bytes(args: TokenFormerArgs, impl: str, dtype: torch.dtype, batch: int, checkpointing: bool,
                          device: str = "cuda") -> int:
    """Activation bytes of a training step of `batch` sequences at its peak, by the accounting above."""
    saved = saved_bytes(args, impl, dtype, device)
    layers, seq = args.num_layers, args.seq_length
    transient = loss_transient_bytes(args, dtype, batch * seq)
    if not checkpointing:
        return saved.total(layers, batch, seq) + transient
    group = min(args.checkpoint_num_layers, layers)
    return saved.total(layers, batch, seq, group) + group * saved.layer(batch, seq) + transient


def parameter_count(args: TokenFormerArgs) -> int:
    return count_parameters_by_component(TokenFormerModel(args, device="meta"))["total_params"]


def model_state_bytes(params: int, data_parallel: int, mixed_precision: bool = True, sharded: bool = True) -> int:
    """Parameters and gradients on every rank (16-bit under mixed precision, else fp32), and the optimizer's
    states (fp32 master weights under mixed precision, Adam's m and v), sharded over the data-parallel ranks
    under ZeRO >= 1 (`sharded`). The default is the ZeRO-1 bf16 run of the module docstring."""
    replicated = (2 + 2) * params if mixed_precision else (FP32 + FP32) * params
    optimizer = (3 if mixed_precision else 2) * FP32 * params
    return replicated + (math.ceil(optimizer / data_parallel) if sharded else optimizer)


def max_micro_batch(args: TokenFormerArgs, impl: str, checkpointing: bool, gpu_bytes: float, reserve: float,
                    data_parallel: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """The most sequences per micro-batch whose peak fits the budget (0: not even one)."""
    budget = (1 - reserve) * gpu_bytes - model_state_bytes(parameter_count(args), data_parallel)
    fixed = peak_activation_bytes(args, impl, dtype, 0, checkpointing)
    per_sequence = peak_activation_bytes(args, impl, dtype, 1, checkpointing) - fixed
    return max(0, math.floor((budget - fixed) / per_sequence))

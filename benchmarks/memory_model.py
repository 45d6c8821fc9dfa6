"""Activation memory of a TokenFormer training step by formula, checked against a measured model, and the
largest micro-batch of each paper config that fits one 80 GiB GPU, for `plain`, `fused` and `flash`.

    .venv/bin/python -m benchmarks.memory_model [--measure-layers 2] [--measure-seq 2048] [--gpu-gib 80]
        [--reserve 0.1] [--data-parallel 8]

Why a formula: what a micro-batch costs decides the batch a GPU can run, and the formula says where the
bytes go and how they scale with d, n, the heads and the vocabulary, for configs too large to build here.
It counts every storage autograd saves for backward in one training forward (model + `lm_loss`), and this
script checks it against exactly that, measured on the CPU: each paper config at full width, reduced depth,
bf16 (benchmarks/activation_memory.saved_storage_bytes; tests/test_memory_model.py does the same on a tiny
model for every implementation, Θ, dtype and option, so a wrong term fails).

Notation: e bytes per activation element (2 bf16/fp16, 4 fp32); z bytes of a layer norm's mean and rstd (e on
the CPU; 4 on CUDA, which keeps them in fp32); d hidden size, h heads, V padded vocabulary, r rotary dims of
a head; a Pattention has n parameter tokens (n_qkv for Q, K, V; n_proj; n_ffn) and outputs d wide.

    per layer and token, all implementations      10·e·d + 4·z + 4·h
        the two norms' inputs (2·e·d) and statistics (4·z); their outputs, the inputs of Q/K/V and of the FFN
        (2·e·d); attention: rotated Q and K (2·e·d, one tensor; none without rotary), the Q/K/V output (3·e·d,
        kept whole by V, a view of it), SDPA's output (e·d; proj's input too, the head merge being a view) and
        its log-sum-exp (4·h)
    + per Pattention (five per layer)
        plain   l2_norm_gelu (c+1)·4·n + e·n + 12    gelu_l2_norm (c+2)·4·n + e·n + 12    softmax 8·n + e·n + 4
                (fp32 [tokens, n] tensors autograd keeps: the scores, c times (2 when e < 4: each fp32 upcast
                is a copy; 1 in fp32), GeLU's input and output or exp's; the weights in e; fp32 row statistics)
        fused   e·n + 8                      (the kept score matrix, fp32 statistic and row factor)
        flash   l2_norm_gelu 8               (the fp32 statistic and row factor: nothing [tokens, ·] wide)
                gelu_l2_norm e·d + 8, softmax e·d + 12  (its output and statistics; 0·d for Q/K/V, whose
                output attention keeps anyway)
    + e·d with τ ≠ 1 for fused and flash: they keep proj's input scaled by τ, a copy of SDPA's output
    per layer and sequence position: 4·r (rotary cos and sin, fp32, shared by the micro-batch's sequences);
    per layer: 20 (the five token counts n)
    model, per token: 2·e·d + 2·z + 8·V + 22 (embedding ids and mask; the final norm's input and statistics;
        the logits GEMM's input; the loss: exp of the shifted fp32 logits and, saved by the label gather, the
        shifted logits themselves, the label index, mask and Σexp); per position 8 with learned positions
    activation checkpointing (groups of k layers): e·d per token for each group's input instead of the layers

So flash's bytes do not depend on n, plain's and fused's grow with it: with l2_norm_gelu (the paper configs')
a Pattention keeps its input and two fp32 numbers per token, where fused keeps e·n bytes more.

Largest micro-batch (sequences of seq_length on one GPU), ZeRO-1 over D data-parallel ranks (default 8):
    model states  2·P (bf16 parameters) + 2·P (bf16 gradients), replicated, + 12·P / D (fp32 master
                  weights, Adam m and v, sharded)
    activations   without checkpointing: every layer's saved bytes + the model's + the loss's transients (the
                  logits in e and their fp32 copy, alive beside the loss's saved tensors: (e + 4)·V per
                  token); with checkpointing: the groups' inputs + one group's saved bytes (recomputed during
                  its backward) + the model's + the loss's transients
    budget        (1 − reserve) · GPU memory − model states; the reserve (default 10 %) is left for the
                  allocator's fragmentation, kernel workspaces, DeepSpeed's communication buckets and the
                  backward's transient buffers (one Pattention's at a time: fused at most two [tokens, n] fp32
                  buffers, flash tile-sized ones; the activations' gradients), which the formula leaves out.
The GPU figures take z = 4 and assume SDPA's flash or memory-efficient kernel (fp32 log-sum-exp, output laid
out [b, s, heads, head_dim], as on the CPU); no dropout (the paper configs have none), tensor parallelism 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from benchmarks.activation_memory import saved_storage_bytes
from benchmarks.paper_configs import PAPER_CONFIGS, paper_args
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.args import NORM_ACTIVATIONS, PATTENTION_IMPLS
from megatron.model.parameter_count import count_parameters_by_component

FP32 = 4
GIB = 2**30


def element_bytes(dtype: torch.dtype) -> int:
    """e: bytes of one activation element; the formula covers 2-byte and 4-byte floats."""
    size = torch.empty((), dtype=dtype).element_size()
    if not dtype.is_floating_point or size not in (2, 4):
        raise ValueError(f"dtype {dtype}: the memory model covers bf16, fp16 and fp32 activations")
    return size


def pattention_bytes_per_token(impl: str, norm_type: str, n: int, d_out: int, e: int,
                               output_kept_elsewhere: bool = False) -> int:
    """Bytes one Pattention of n tokens saves per input token besides its input (module docstring).

    `output_kept_elsewhere`: its output is saved by another node anyway (Q, K, V: attention's V is a view of
    it), so flash's saved output costs nothing more.
    """
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
        if norm_type == "l2_norm_gelu":
            return 2 * FP32
        statistics = 2 * FP32 if norm_type == "gelu_l2_norm" else 3 * FP32
        return (0 if output_kept_elsewhere else e * d_out) + statistics
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
    if args.hidden_dropout or args.attention_dropout:
        raise ValueError("the memory model assumes no dropout (the paper configs have none)")
    if args.norm_activation_type not in NORM_ACTIVATIONS:
        raise ValueError(f"norm_activation_type={args.norm_activation_type!r}")
    e, d, h, vocab = element_bytes(dtype), args.hidden_size, args.num_attention_heads, args.padded_vocab_size
    z = e if device == "cpu" else max(e, FP32)
    norms = 2 * (e * d + 2 * z)
    # fused and flash keep τ·x, a new tensor when τ ≠ 1: for Q/K/V and the FFN in place of the norm's output,
    # for proj besides SDPA's output, which attention keeps anyway
    scaled_proj_input = e * d if impl != "plain" and args.pattention_tau != 1.0 else 0
    pattention_inputs = 2 * e * d + scaled_proj_input
    rotated = 2 * e * d if args.rotary_dims else 0  # without rotary, Q and K are views of the Q/K/V output
    attention = rotated + 3 * e * d + e * d + FP32 * h

    def pattention(n: int, kept_elsewhere: bool = False) -> int:
        return pattention_bytes_per_token(impl, args.norm_activation_type, n, d, e, kept_elsewhere)

    pattentions = 3 * pattention(args.qkv_slot_num, True) + pattention(args.proj_slot_num) + pattention(
        args.ffn_slot_num)
    embedding = 8 + 1
    final_norm = e * d + 2 * z
    logits_input = e * d
    loss = 2 * FP32 * vocab + 8 + 1 + FP32
    return SavedBytes(
        layer_per_token=norms + pattention_inputs + attention + pattentions,
        layer_per_position=2 * FP32 * (args.rotary_dims // 2),
        layer_fixed=5 * FP32,
        model_per_token=embedding + final_norm + logits_input + loss,
        model_per_position=8 if args.pos_emb == "learned" else 0,
        checkpoint_input_per_token=e * d,
    )


def loss_transient_per_token(args: TokenFormerArgs, dtype: torch.dtype) -> int:
    """Bytes per token alive at the loss besides what it saves: the logits (e) and their fp32 copy (none in fp32)."""
    e = element_bytes(dtype)
    return (e + (FP32 if e < FP32 else 0)) * args.padded_vocab_size


def peak_activation_bytes(args: TokenFormerArgs, impl: str, dtype: torch.dtype, batch: int, checkpointing: bool,
                          device: str = "cuda") -> int:
    """Activation bytes of a training step of `batch` sequences at its peak, by the accounting above."""
    saved = saved_bytes(args, impl, dtype, device)
    layers, seq = args.num_layers, args.seq_length
    transient = loss_transient_per_token(args, dtype) * batch * seq
    if not checkpointing:
        return saved.total(layers, batch, seq) + transient
    group = min(args.checkpoint_num_layers, layers)
    return saved.total(layers, batch, seq, group) + group * saved.layer(batch, seq) + transient


def parameter_count(args: TokenFormerArgs) -> int:
    return count_parameters_by_component(TokenFormerModel(args, device="meta"))["total_params"]


def model_state_bytes(params: int, data_parallel: int) -> int:
    """ZeRO-1: bf16 parameters and gradients on every rank, fp32 master weights, Adam m and v sharded."""
    return 2 * params + 2 * params + math.ceil(3 * FP32 * params / data_parallel)


def max_micro_batch(args: TokenFormerArgs, impl: str, checkpointing: bool, gpu_bytes: float, reserve: float,
                    data_parallel: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """The most sequences per micro-batch whose peak fits the budget (0: not even one)."""
    budget = (1 - reserve) * gpu_bytes - model_state_bytes(parameter_count(args), data_parallel)
    fixed = peak_activation_bytes(args, impl, dtype, 0, checkpointing)
    per_sequence = peak_activation_bytes(args, impl, dtype, 1, checkpointing) - fixed
    return max(0, math.floor((budget - fixed) / per_sequence))


def measured_saved_bytes(args: TokenFormerArgs, dtype: torch.dtype, batch: int = 1, seed: int = 0) -> int:
    """Storages autograd saves in one training forward (model, then the training step's `lm_loss`) of the
    model `args` describe, built on the CPU in `dtype`; parameters not counted."""
    from megatron.training.step import lm_loss

    model = TokenFormerModel(args).to(dtype)
    tokens = torch.randint(0, args.padded_vocab_size, (batch, args.seq_length + 1),
                           generator=torch.Generator().manual_seed(seed))
    return saved_storage_bytes(lambda: lm_loss(model(tokens[:, :-1]), tokens[:, 1:]), exclude=model.parameters())


def _check_rows(configs: dict[str, TokenFormerArgs], layers: int, seq: int) -> Iterator[tuple[str, str, int, int]]:
    """(config, what, measured, formula) for each config and implementation, and checkpointing, in bf16."""
    for name, full in configs.items():
        args = dataclasses.replace(full, num_layers=layers, seq_length=seq, max_position_embeddings=seq,
                                   checkpoint_activations=False)
        for impl in PATTENTION_IMPLS:
            run = dataclasses.replace(args, pattention_impl=impl, flash_backend="pytorch")
            formula = saved_bytes(run, impl, torch.bfloat16, "cpu").total(layers, 1, seq)
            yield name, impl, measured_saved_bytes(run, torch.bfloat16), formula
        run = dataclasses.replace(args, pattention_impl="flash", flash_backend="pytorch", checkpoint_activations=True)
        formula = saved_bytes(run, "flash", torch.bfloat16, "cpu").total(layers, 1, seq, run.checkpoint_num_layers)
        yield name, "checkpointed", measured_saved_bytes(run, torch.bfloat16), formula


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure-layers", type=int, default=2, help="depth of the measured models")
    parser.add_argument("--measure-seq", type=int, default=2048, help="sequence length of the measured models")
    parser.add_argument("--gpu-gib", type=float, default=80.0)
    parser.add_argument("--reserve", type=float, default=0.10, help="share of GPU memory left for the rest")
    parser.add_argument("--data-parallel", type=int, default=8, help="ZeRO-1 ranks sharding the optimizer state")
    options = parser.parse_args()
    configs = {name: paper_args(name) for name in PAPER_CONFIGS}

    print(f"Measured (this CPU, bf16, {options.measure_layers} layers, seq {options.measure_seq}, batch 1) vs "
          "formula: bytes saved for backward by one training forward")
    header = f"{'config':<7} {'impl':<13} {'measured MiB':>13} {'formula MiB':>12} {'formula/measured':>17}"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for name, what, measured, formula in _check_rows(configs, options.measure_layers, options.measure_seq):
        worst = max(worst, abs(formula / measured - 1))
        print(f"{name:<7} {what:<13} {measured / 2**20:>13.2f} {formula / 2**20:>12.2f} {formula / measured:>17.6f}",
              flush=True)
    print(f"largest |formula / measured - 1| = {worst:.1e}\n")

    gpu = options.gpu_gib * GIB
    print(f"Memory model: seq 2048, bf16, CUDA; ZeRO-1 over {options.data_parallel} ranks (2P + 2P + 12P/"
          f"{options.data_parallel} bytes of model states), {options.gpu_gib:g} GiB GPU, "
          f"{options.reserve:.0%} reserve")
    header = (f"{'config':<7} {'d':>5} {'layers':>6} {'params':>7} | {'activation GiB / sequence':^26} | "
              f"{'max micro-batch':^17} | {'with checkpointing':^18}")
    sub = f"{'':<7} {'':>5} {'':>6} {'':>7} | {'plain':>8} {'fused':>8} {'flash':>8} | " + \
          f"{'plain':>5} {'fused':>5} {'flash':>5} | {'plain':>5} {'fused':>5} {'flash':>6}"
    print(header)
    print(sub)
    print("-" * len(sub))
    results = {}
    for name, args in configs.items():
        per_sequence = {impl: saved_bytes(args, impl, torch.bfloat16, "cuda").total(args.num_layers, 1,
                                                                                     args.seq_length)
                        for impl in PATTENTION_IMPLS}
        fits = {(impl, ckpt): max_micro_batch(args, impl, ckpt, gpu, options.reserve, options.data_parallel)
                for ckpt in (False, True) for impl in PATTENTION_IMPLS}
        results[name] = per_sequence, fits
        print(f"{name:<7} {args.hidden_size:>5} {args.num_layers:>6} {parameter_count(args) / 1e9:>6.2f}B | "
              + " ".join(f"{per_sequence[impl] / GIB:>8.2f}" for impl in PATTENTION_IMPLS) + " | "
              + " ".join(f"{fits[impl, False]:>5}" for impl in PATTENTION_IMPLS) + " | "
              + " ".join(f"{fits[impl, True]:>5}" for impl in PATTENTION_IMPLS))
    largest = configs[PAPER_CONFIGS[-1]]
    by_norm = []
    for norm in NORM_ACTIVATIONS:
        args = dataclasses.replace(largest, norm_activation_type=norm)
        flash, fused = (saved_bytes(args, impl, torch.bfloat16, "cuda").total(args.num_layers, 1, args.seq_length)
                        for impl in ("flash", "fused"))
        by_norm.append(f"{norm} {flash / fused:.2f}")
    print(f"flash / fused activation bytes at {PAPER_CONFIGS[-1]} by Θ (formula): " + ", ".join(by_norm))
    per_sequence, fits = results[PAPER_CONFIGS[-1]]
    print(f"ratio: flash / fused activation bytes at {PAPER_CONFIGS[-1]} = "
          f"{per_sequence['flash'] / per_sequence['fused']:.2f}; largest micro-batch without checkpointing at "
          f"{PAPER_CONFIGS[-1]}: plain {fits['plain', False]}, fused {fits['fused', False]}, "
          f"flash {fits['flash', False]}")


if __name__ == "__main__":
    main()

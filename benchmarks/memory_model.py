"""Activation memory of a TokenFormer training step by formula, checked against a measured model, and the
largest micro-batch of each paper config that fits one 80 GiB GPU, for `plain`, `fused` and `flash`.

    .venv/bin/python -m benchmarks.memory_model [--measure-layers 2] [--measure-seq 2048] [--gpu-gib 80]
        [--reserve 0.1] [--data-parallel 8]

The formula (megatron/model/memory.py, which lists its terms and the ZeRO-1 accounting of the largest
micro-batch) counts every storage autograd saves for backward in one training forward (model + `lm_loss`), and
this script checks it against exactly that, measured on the CPU: each paper config at full width, reduced
depth, bf16 (benchmarks/activation_memory.saved_storage_bytes; tests/test_memory_model.py does the same on a
tiny model for every implementation, Θ, dtype and option, so a wrong term fails).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator

import torch

from benchmarks.activation_memory import saved_storage_bytes
from benchmarks.paper_configs import PAPER_CONFIGS, paper_args
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.args import NORM_ACTIVATIONS, PATTENTION_IMPLS
from megatron.model.memory import GIB, max_micro_batch, parameter_count, saved_bytes

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

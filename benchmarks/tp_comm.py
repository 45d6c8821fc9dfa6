"""Tensor-parallel bytes per layer per token, measured on real gloo ranks, vs the documented formula.

    .venv/bin/python -m benchmarks.tp_comm [--sizes 2 4] [--tokens 128]

For each paper config (its width, heads and slot counts), t ranks run one TokenFormer layer forward and
backward while megatron/mpu/collectives.py logs every tensor-parallel collective; the bytes each rank
sends (ring algorithm) per token are compared with docs/tensor_parallel.md's formula
(benchmarks/tp_traffic.py) and with a Megatron transformer layer of the same width (formula only:
two all-reduces of d forward, two backward). The last line gives the largest deviation of the measured
bytes from the formula, and TokenFormer's bytes over Megatron's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

from benchmarks.tp_traffic import megatron_bytes_per_token, tokenformer_bytes_per_token
from megatron import mpu
from megatron.model import TokenFormerArgs
from megatron.model.layer import TokenFormerLayer
from megatron.mpu.collectives import count_collectives
from tests.distributed import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = ("150M", "450M", "900M", "1-5B")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NORM_TYPES = ("l2_norm_gelu", "softmax")
BATCH = 2


def layer_args(config: str, norm_type: str, tokens: int) -> TokenFormerArgs:
    """One layer of the config's shape, `tokens` tokens per step."""
    values = yaml.safe_load((ROOT / "configs" / f"{config}.yml").read_text())
    return TokenFormerArgs.from_config(SimpleNamespace(**values), padded_vocab_size=64, num_layers=1,
                                       seq_length=tokens // BATCH, max_position_embeddings=tokens // BATCH,
                                       norm_activation_type=norm_type)


def measure(tensor_size: int, tokens: int) -> dict:
    """On each rank: (config, Θ, dtype) -> (bytes sent per token, forward calls, backward calls)."""
    mpu.initialize_model_parallel(tensor_size)
    mpu.seed_model_parallel_rng(0)
    results = {}
    for config in CONFIGS:
        for norm_type in NORM_TYPES:
            args = layer_args(config, norm_type, tokens)
            layer = TokenFormerLayer(args)
            for name, dtype in DTYPES.items():
                layer = layer.to(dtype)
                x = torch.randn(BATCH, tokens // BATCH, args.hidden_size, dtype=dtype, requires_grad=True)
                with count_collectives() as forward:
                    y = layer(x)
                with count_collectives() as backward:
                    y.backward(torch.ones_like(y))
                sent = sum(c.bytes_sent_per_rank(tensor_size) for c in forward + backward) / tokens
                results[(config, norm_type, name)] = (sent, len(forward), len(backward))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    header = (f"{'config':<6} {'d':>5} {'t':>2} {'dtype':<5} {'Θ':<13} {'calls f/b':>9} {'measured':>9} "
              f"{'formula':>9} {'meas/form':>9} {'Megatron':>9} {'TF/Megatron':>11}")
    print(f"bytes sent per rank per layer per token, forward + backward ({args.tokens} tokens per step)")
    print(header)
    print("-" * len(header))
    deviation, versus_megatron = 0.0, []
    for tensor_size in args.sizes:
        ranks = run_on_ranks(tensor_size, measure, tensor_size, args.tokens)
        if any(r != ranks[0] for r in ranks):
            raise AssertionError("ranks disagree on the bytes they sent")
        for (config, norm_type, name), (sent, calls_forward, calls_backward) in ranks[0].items():
            d = layer_args(config, norm_type, args.tokens).hidden_size
            element_size = DTYPES[name].itemsize
            formula = tokenformer_bytes_per_token(d, tensor_size, element_size, norm_type)
            megatron = megatron_bytes_per_token(d, tensor_size, element_size)
            deviation = max(deviation, abs(sent / formula - 1))
            versus_megatron.append(sent / megatron)
            print(f"{config:<6} {d:>5} {tensor_size:>2} {name:<5} {norm_type:<13} "
                  f"{f'{calls_forward}/{calls_backward}':>9} {sent:>9.0f} {formula:>9.0f} {sent / formula:>9.4f} "
                  f"{megatron:>9.0f} {sent / megatron:>11.2f}", flush=True)
    print(f"ratio: measured / formula = 1 ± {deviation:.1e} (largest deviation); TokenFormer / Megatron bytes "
          f"= {min(versus_megatron):.2f}-{max(versus_megatron):.2f}")


if __name__ == "__main__":
    main()

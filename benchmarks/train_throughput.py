"""Training-step throughput of TokenFormer vs transformers' GPTNeoXForCausalLM of equal size and FLOPs.

    .venv/bin/pip install -r requirements/requirements-bench.txt
    .venv/bin/python -m benchmarks.train_throughput [--hidden 768 --heads 12 --layers 4 --seq 512 --batch 4]
        [--threads N] [--repeats 5] [--clock wall|cpu]

The default width and heads are the 150M config's (d = 768, 12 heads), with 4 layers, 512-token
sequences and an 8192-token vocabulary to fit this CPU. A TokenFormer layer with qkv = proj = d and
ffn = 4d parameter tokens (the paper's ratios) holds 16·d² parameters and costs 32·d² forward FLOPs
per token in its projections; a GPT-NeoX layer with an MLP width of 6d holds (and costs) the same, so
the two models match in parameters and in FLOPs per token (attention and logits are identical). Both
run in one process with the same threads, batch, sequence length and AdamW; a step is forward +
backward + optimizer update, the models alternate, and each keeps its fastest step
(benchmarks/timing.py). FLOP/s use the training formula of megatron/model/flops.py for both models
(same count); the GEMM peak is the fastest large fp32 matmul measured here (before and after the
steps), "of peak" the achieved FLOP/s over it. TokenFormer runs with each of its two fast Pattention
implementations; the last line is the default's (pattention_impl: auto, decided for this batch and machine as a
training run decides it) tokens/s over GPT-NeoX's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.timing import add_arguments, fastest
from megatron.model import TokenFormerArgs, TokenFormerModel, flops_per_token


def gemm_peak_flops(repeats: int, clock: str, size: int = 2048) -> float:
    """FLOP/s of the fastest of `repeats` fp32 [size, size] matmuls."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / fastest({"gemm": lambda: a @ b}, repeats, clock)["gemm"]


def tokenformer_args(args: argparse.Namespace, impl: str) -> TokenFormerArgs:
    d = args.hidden
    return TokenFormerArgs(
        padded_vocab_size=args.vocab, hidden_size=d, num_layers=args.layers, num_attention_heads=args.heads,
        qkv_slot_num=d, proj_slot_num=d, ffn_slot_num=4 * d, seq_length=args.seq, rotary_pct=0.25,
        output_layer_init_method="wang_init", pattention_impl=impl)


def default_impl(args: argparse.Namespace) -> str:
    """What pattention_impl: auto, the config's default, picks for this model and batch on this machine (one
    fp32 process)."""
    from deepspeed.accelerator import get_accelerator

    from megatron.model.rank_memory import RunShape
    from megatron.training.pattention_choice import choose_pattention_impl

    shape = RunShape(micro_batch=args.batch, precision="fp32", zero_stage=0, data_parallel=1, tensor_parallel=1,
                     pipeline_parallel=1)
    return choose_pattention_impl(tokenformer_args(args, "fused"), shape, "cpu",
                                  int(get_accelerator().total_memory()))[0]


def gpt_neox(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=6 * args.hidden, max_position_embeddings=args.seq,
        rotary_pct=0.25, use_parallel_residual=False, tie_word_embeddings=True, attn_implementation="sdpa")
    model = GPTNeoXForCausalLM(config)

    class LogitsOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, tokens):
            return self.model(input_ids=tokens).logits

    return LogitsOnly()


def training_step(model: torch.nn.Module, args: argparse.Namespace) -> Callable[[], None]:
    """Forward, backward and AdamW update of `model` on one fixed batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)

    def step() -> None:
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    default = default_impl(args)
    models = {f"TokenFormer {impl}": TokenFormerModel(tokenformer_args(args, impl)) for impl in ("fused", "flash")}
    models["GPTNeoXForCausalLM"] = gpt_neox(args)
    flops = flops_per_token(tokenformer_args(args, default), include_recompute=False)
    first_peak = gemm_peak_flops(args.repeats, args.clock)
    best = fastest({name: training_step(model, args) for name, model in models.items()}, args.repeats, args.clock)
    rates = {name: args.batch * args.seq / seconds for name, seconds in best.items()}
    peak = max(first_peak, gemm_peak_flops(args.repeats, args.clock))  # before and after the steps
    print(f"threads={torch.get_num_threads()} d={args.hidden} layers={args.layers} seq={args.seq} "
          f"batch={args.batch} vocab={args.vocab}; GEMM peak {peak / 1e9:.1f} GFLOP/s; fastest of "
          f"{args.repeats} alternating steps ({args.clock} clock)")
    header = f"{'model':<20} {'params':>10} {'tokens/s':>10} {'GFLOP/s':>9} {'of peak':>8} {'/ GPT-NeoX':>10}"
    print(header)
    print("-" * len(header))
    neox = rates["GPTNeoXForCausalLM"]
    for name, model in models.items():
        params = sum(p.numel() for p in model.parameters())
        achieved = rates[name] * flops
        print(f"{name:<20} {params / 1e6:>9.2f}M {rates[name]:>10,.0f} {achieved / 1e9:>9.1f} {achieved / peak:>8.0%} "
              f"{rates[name] / neox:>10.2f}")
    print(f"ratio: TokenFormer tokens/s (the default, pattention_impl: auto -> {default}) / GPTNeoXForCausalLM "
          f"tokens/s = {rates[f'TokenFormer {default}'] / neox:.2f}")


if __name__ == "__main__":
    main()

"""Flash Pattention on one CUDA GPU: its Triton forward+backward time over the six GEMMs', and the MFU of
training steps of the paper configs at reduced depth, flash vs fused.

    .venv/bin/python -m benchmarks.gpu_pattention [--tokens 16384] [--dtype bf16|fp32] [--repeats 10]
        [--layers 2] [--batch 4] [--configs 150M 1-5B] [--no-steps] [--profile] [--blocks-sweep] [--tiles-sweep]
        [--peak-tflops T] [--json FILE]

Needs a CUDA device and Triton. Without them it prints one line saying so (stderr) and exits with status 2:
nothing was measured, which is neither a result (0) nor a failure of the code (1), so a script running it on
a CPU machine can tell the three apart.

Kernels: benchmarks/pattention.py's shapes (the paper configs' Pattentions; "×3" is attention's Q, K and V in one
node) and the 1-5B config's Q/K/V and FFN at --tokens input tokens (default 8 sequences of 2048), every Θ: flash
with its Triton kernels, fused with its Triton Θ (what CUDA runs) and with its PyTorch passes ("f-pt", the CPU's
path), and the six GEMMs a Pattention needs alone (the limit), forward + backward in
--dtype; each keeps its fastest of --repeats alternating runs (benchmarks/timing.py), every run ended by
torch.cuda.synchronize. "peak fl/f" is flash's peak memory over fused's (Triton Θ) during forward + backward
(torch.cuda.max_memory_allocated above what was allocated before the step; the layer's output and the gradients
included).

Training steps: each paper config at --layers layers (full width and vocabulary), sequences of 2048,
--batch of them per step, bf16 parameters, fused AdamW; a step is forward, the training loss (lm_loss),
backward and the optimizer step, flash and fused alternating. MFU = tokens/s × training FLOPs per token
(megatron/model/flops.py, no recomputation) / peak FLOP/s: the fastest bf16 8192² matmul measured here, or
--peak-tflops (e.g. the data sheet's dense bf16 figure). The allocator is set up as a training rank's
(megatron/runtime/entry.py: expandable segments).

"flash" is what auto runs on CUDA: blocks of rows (flash.py), Θ in Triton tiles; "kern" its whole-Pattention
Triton kernels for the l2 Θ (megatron/model/pattention/flash_triton.py, flash_backend: kernels). "launches" gives
the kernels one forward + backward of each launches at the 1-5B FFN shape (benchmarks/launches.py).
--tiles-sweep times the kernels (l2_norm_gelu) at the 1-5B shapes with each tile configuration of TILES_SWEEP,
with their peak memory: the figures that set flash_triton.TILES on a GPU.
--blocks-sweep times the blocks (softmax) cutting the --tokens input rows into each number of blocks of
BLOCKS_SWEEP, with its peak memory: the figures that set flash.BLOCKS and flash.MIN_ROWS on a GPU.
--profile prints torch.profiler's kernel table of one flash, kernels and fused forward + backward (l2_norm_gelu,
the 1-5B FFN shape). --no-steps times the kernels only (benchmarks/gpu_check.py
measures training through deepy.py instead); --json also writes every row to FILE.

Last line: "ratio: flash (Triton) Pattention time / six GEMMs = X (all shapes and Θ; worst Y); training-step
MFU at <largest config>: flash A, fused B".
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from collections.abc import Callable

import torch

from benchmarks.timing import fastest
from megatron.model.pattention.registry import FLASH_KERNEL_THETAS

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEVICE = "cuda"  # every tensor is placed through this name
UNAVAILABLE_EXIT = 2


def unavailable_reason() -> str | None:
    """Why this benchmark cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False); nothing measured"
    if importlib.util.find_spec("triton") is None:
        return "needs Triton (not installed); nothing measured"
    return None


def synchronized(step: Callable[[], object]) -> Callable[[], None]:
    """`step` followed by waiting for the GPU: a timed run ends when its kernels do."""
    def run() -> None:
        step()
        torch.cuda.synchronize()
    return run


def peak_step_bytes(step: Callable[[], object]) -> int:
    """Most bytes allocated at once during `step`, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def matmul_peak_flops(repeats: int, size: int = 8192, count: int = 10) -> float:
    """FLOP/s of the fastest of `repeats` runs of `count` bf16 [size, size] matmuls."""
    a, b = (torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    seconds = fastest({"mm": synchronized(lambda: [a @ b for _ in range(count)])}, repeats)["mm"]
    return count * 2 * size**3 / seconds


def on_gpu(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A CUDA copy of t in `dtype`, a leaf requiring gradient when t does."""
    return t.detach().to(DEVICE, dtype).requires_grad_(t.requires_grad)


def by_registry(impl: str, backend: str) -> Callable:
    """Pattention `impl` with tile backend `backend`, in benchmarks/pattention.py's calling convention."""
    from megatron.model.pattention import pattentions_function

    def compute(x, keys, values, norm_type):
        return pattentions_function(impl, backend)(x, keys, values, norm_type, 1.0, [k.shape[0] for k in keys])
    return compute


flash = by_registry("flash", "triton")  # its blocks of rows, Θ in Triton tiles: what auto runs on CUDA
kernels = by_registry("flash", "kernels")  # its whole-Pattention Triton kernels (l2 Θ), flash_backend: kernels
fused = by_registry("fused", "triton")  # what `pattention_impl: fused` runs on CUDA
fused_pytorch = by_registry("fused", "pytorch")  # its PyTorch passes, the CPU's path


def shape_tensors(shape: tuple[str, int, int, int], tokens: int, dtype: torch.dtype) -> tuple:
    """(x, keys, values, grad_out) of one Pattention shape on the GPU in `dtype`."""
    from benchmarks.pattention import tensors

    _, d, n, count = shape
    x, keys, values, grad_out = tensors(tokens, d, n, count)
    return (on_gpu(x, dtype), [on_gpu(k, dtype) for k in keys], [on_gpu(v, dtype) for v in values],
            on_gpu(grad_out, dtype))


def kernel_row(norm_type: str, shape: tuple[str, int, int, int], tokens: int, dtype: torch.dtype,
               repeats: int) -> dict:
    """One Θ and shape: the variants' fastest times and flash's peak memory (and its kernels') over fused's."""
    from benchmarks.pattention import forward_backward, gemms_only

    name, d, n, _ = shape
    x, keys, values, grad_out = shape_tensors(shape, tokens, dtype)
    steps = {"gemms": lambda: gemms_only(x, keys, values, grad_out),
             "fused": forward_backward(fused, x, keys, values, norm_type, grad_out),
             "fused pytorch": forward_backward(fused_pytorch, x, keys, values, norm_type, grad_out),
             "flash": forward_backward(flash, x, keys, values, norm_type, grad_out)}
    if norm_type in FLASH_KERNEL_THETAS:
        steps["kernels"] = forward_backward(kernels, x, keys, values, norm_type, grad_out)
    times = fastest({key: synchronized(step) for key, step in steps.items()}, repeats)
    peaks = {}
    for key in [key for key in steps if key != "gemms"]:
        for t in (x, *keys, *values):
            t.grad = None
        peaks[key] = peak_step_bytes(steps[key])
    return {"norm": norm_type, "name": name, "d": d, "n": n, **times, "peak": peaks["flash"] / peaks["fused"],
            "peak vs fused pytorch": peaks["flash"] / peaks["fused pytorch"],
            "kernels peak": peaks["kernels"] / peaks["fused"] if "kernels" in peaks else None}


# benchmarks/pattention.py's configs (sized for a CPU) and the largest, which a GPU can afford.
GPU_CONFIGS = ("150M", "450M", "1-5B")


def kernel_rows(tokens: int, dtype: torch.dtype, repeats: int) -> list[dict]:
    """kernel_row for every Θ and shape."""
    from benchmarks.pattention import NORM_TYPES, shapes

    rows = []
    for norm_type in NORM_TYPES:
        for shape in shapes(GPU_CONFIGS):
            rows.append(kernel_row(norm_type, shape, tokens, dtype, repeats))
            torch.cuda.empty_cache()
    return rows


def launch_counts(tokens: int, dtype: torch.dtype) -> list[dict]:
    """Kernels one forward + backward launches at the 1-5B FFN shape, flash, its kernels and fused, for each l2 Θ."""
    from benchmarks.launches import device_launches
    from benchmarks.pattention import forward_backward

    x, keys, values, grad_out = shape_tensors(largest_ffn_shape(), tokens, dtype)
    rows = []
    for norm_type in FLASH_KERNEL_THETAS:
        row = {"norm": norm_type}
        for name, function in (("flash", flash), ("kernels", kernels), ("fused", fused)):
            step = forward_backward(function, x, keys, values, norm_type, grad_out)
            step()  # compiled before it is counted
            row[name] = dataclasses.asdict(device_launches(step))
        rows.append(row)
    return rows


# Tile configurations of flash's Triton kernels timed at the largest config's shapes (rows and parameter tokens of
# a score tile, its reduction step, an output tile's width, warps): the data that sets flash_triton.TILES on a GPU.
TILES_SWEEP = ((64, 64, 64, 128, 8), (64, 64, 32, 128, 8), (64, 32, 32, 256, 8), (64, 64, 32, 256, 8))


def tiles_sweep(tokens: int, dtype: torch.dtype, repeats: int) -> list[dict]:
    """flash's kernels (l2_norm_gelu) at the largest config's shapes with each tile configuration of TILES_SWEEP,
    and flash's blocks with the Triton tiles on the same Θ ("blocks", what auto runs): time over the six GEMMs'
    and peak memory (MiB), alternating as the kernel rows do. "default" marks flash_triton.TILES' own."""
    from benchmarks.pattention import config_shapes, forward_backward, gemms_only
    from megatron.model.pattention import flash_triton

    default = flash_triton.TILES["default"]

    def with_tiles(sizes: tuple, step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            m, n, k, d, warps = sizes
            flash_triton.TILES["default"] = flash_triton.Tiles(m, n, k, d, warps=warps)
            try:
                step()
            finally:
                flash_triton.TILES["default"] = default
        return run

    results = []
    for shape in config_shapes(GPU_CONFIGS[-1]):
        x, keys, values, grad_out = shape_tensors(shape, tokens, dtype)
        steps = {"gemms": lambda: gemms_only(x, keys, values, grad_out)}
        for sizes in TILES_SWEEP:
            steps[sizes] = with_tiles(sizes, forward_backward(kernels, x, keys, values, "l2_norm_gelu", grad_out))
            steps[sizes]()  # compiled before it is timed
        steps["blocks"] = forward_backward(flash, x, keys, values, "l2_norm_gelu", grad_out)
        times = fastest({key: synchronized(step) for key, step in steps.items()}, repeats)
        for sizes in (*TILES_SWEEP, "blocks"):
            for t in (x, *keys, *values):
                t.grad = None
            results.append({"name": shape[0], "tiles": sizes if sizes == "blocks" else "x".join(map(str, sizes[:4])),
                            "warps": 0 if sizes == "blocks" else sizes[4], "over_gemms": times[sizes] / times["gemms"],
                            "peak_mib": peak_step_bytes(steps[sizes]) / 2**20,
                            "default": sizes == (default.m, default.n, default.k, default.d, default.warps)})
        torch.cuda.empty_cache()
    return results


# Numbers of row blocks flash is timed with at the largest config's shapes: the data that sets flash.BLOCKS (and
# flash.MIN_ROWS) on a GPU; at 16,384 tokens 8192 to 1024 rows a block.
BLOCKS_SWEEP = (2, 4, 8, 16)


def blocks_sweep(tokens: int, dtype: torch.dtype, repeats: int) -> list[dict]:
    """flash's blocks (softmax, the Θ they run on a GPU) at the largest config's shapes with its input rows cut
    into each of BLOCKS_SWEEP blocks (MIN_ROWS set aside): its time over the six GEMMs' and its peak memory (MiB),
    alternating as the kernel rows do. "default" marks the blocks flash cuts at these tokens by its own BLOCKS
    and MIN_ROWS."""
    from benchmarks.pattention import forward_backward, gemms_only
    from megatron.model.pattention import flash as flash_module

    settings = flash_module.BLOCKS, flash_module.MIN_ROWS
    default_rows = flash_module.rows_per_block(tokens, torch.device(DEVICE))

    def with_blocks(blocks: int, step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            flash_module.BLOCKS = {"cpu": blocks, "default": blocks}
            flash_module.MIN_ROWS = {"cpu": 1, "default": 1}
            try:
                step()
            finally:
                flash_module.BLOCKS, flash_module.MIN_ROWS = settings
        return run

    from benchmarks.pattention import config_shapes

    results = []
    for shape in config_shapes(GPU_CONFIGS[-1]):
        x, keys, values, grad_out = shape_tensors(shape, tokens, dtype)
        steps = {"gemms": lambda: gemms_only(x, keys, values, grad_out)}
        for blocks in BLOCKS_SWEEP:
            steps[blocks] = with_blocks(blocks, forward_backward(flash, x, keys, values, "softmax", grad_out))
        times = fastest({key: synchronized(step) for key, step in steps.items()}, repeats)
        for blocks in BLOCKS_SWEEP:
            for t in (x, *keys, *values):
                t.grad = None
            rows = -(-tokens // blocks)
            results.append({"name": shape[0], "blocks": blocks, "rows": rows,
                            "over_gemms": times[blocks] / times["gemms"],
                            "peak_mib": peak_step_bytes(steps[blocks]) / 2**20, "default": rows == default_rows})
        torch.cuda.empty_cache()
    return results


def largest_ffn_shape() -> tuple[str, int, int, int]:
    """The largest config's Pattention with the most tokens (its FFN)."""
    from benchmarks.pattention import config_shapes

    return max(config_shapes(GPU_CONFIGS[-1]), key=lambda shape: shape[2])


def kernel_profile(norm_type: str, shape: tuple[str, int, int, int], tokens: int, dtype: torch.dtype) -> str:
    """torch.profiler's table of the GPU kernels of one flash and one fused forward + backward (after a warm-up
    run), by their total device time: where flash's time goes beyond the GEMMs."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.pattention import forward_backward

    name, d, n, _ = shape
    x, keys, values, grad_out = shape_tensors(shape, tokens, dtype)
    tables = []
    for label, function in (("flash", flash), ("kernels", kernels), ("fused", fused)):
        step = synchronized(forward_backward(function, x, keys, values, norm_type, grad_out))
        step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
        tables.append(f"{label}, {norm_type}, {name} (d={d}, n={n}), {tokens} tokens:\n{table}")
    return "\n".join(tables)


def training_step(args, batch: int) -> Callable[[], None]:
    """One bf16 training step (forward, lm_loss, backward, AdamW) of the model `args` describe, on one batch."""
    from megatron.model import TokenFormerModel
    from megatron.training.step import lm_loss

    model = TokenFormerModel(args).to(device=DEVICE, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.padded_vocab_size, (batch, args.seq_length + 1), generator=generator).to(DEVICE)

    def step() -> None:
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return synchronized(step)


def step_row(name: str, layers: int, batch: int, repeats: int, peak: float) -> dict:
    """Tokens/s and MFU of flash and fused training steps of config `name` at `layers` layers."""
    from benchmarks.paper_configs import paper_args
    from megatron.model import flops_per_token

    args = paper_args(name, num_layers=layers, checkpoint_activations=False, flash_backend="auto")
    row = {"name": name, "d": args.hidden_size}
    try:
        steps = {impl: training_step(dataclasses.replace(args, pattention_impl=impl), batch)
                 for impl in ("flash", "fused")}
        times = fastest(steps, repeats)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {**row, "oom": True}
    flops = flops_per_token(args, include_recompute=False)
    for impl, seconds in times.items():
        row[f"{impl} tokens/s"] = batch * args.seq_length / seconds
        row[f"{impl} mfu"] = row[f"{impl} tokens/s"] * flops / peak
    del steps
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8 * 2048, help="input tokens of the kernel timings")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="of the kernel timings")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2, help="depth of the training-step models")
    parser.add_argument("--batch", type=int, default=4, help="sequences of 2048 tokens per training step")
    parser.add_argument("--configs", nargs="+", default=None, help="paper configs to step (default: all)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak bf16 TFLOP/s for the MFU (default: the fastest matmul measured here)")
    parser.add_argument("--no-steps", action="store_true", help="time the kernels only")
    parser.add_argument("--profile", action="store_true",
                        help="also print the GPU kernels of flash and fused at the 1-5B FFN shape (torch.profiler)")
    parser.add_argument("--blocks-sweep", action="store_true",
                        help=f"also time flash's blocks (softmax) with the input rows in "
                             f"{', '.join(map(str, BLOCKS_SWEEP))} blocks")
    parser.add_argument("--tiles-sweep", action="store_true",
                        help="also time flash's Triton kernels with each tile configuration of TILES_SWEEP")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    options = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"benchmarks.gpu_pattention: {reason}", file=sys.stderr)
        sys.exit(UNAVAILABLE_EXIT)
    from megatron.runtime.entry import use_training_allocator

    use_training_allocator("cuda")  # before the first device call: measured with the allocator training uses

    from benchmarks.paper_configs import PAPER_CONFIGS

    dtype = DTYPES[options.dtype]
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; tokens={options.tokens} {options.dtype} "
          f"(TF32 matmul {torch.backends.cuda.matmul.allow_tf32}); fastest of {options.repeats} alternating runs (ms)")
    header = (f"{'Θ':<13} {'layer':<14} {'d':>5} {'n':>5} {'GEMMs':>8} {'fused':>8} {'flash':>8} "
              f"{'fused/G':>8} {'flash/G':>8} {'f-pt/G':>8} {'peak fl/f':>9} {'kern/G':>8} {'peak k/f':>9}")
    print(header)
    print("-" * len(header))
    rows = kernel_rows(options.tokens, dtype, options.repeats)
    for r in rows:
        print(f"{r['norm']:<13} {r['name']:<14} {r['d']:>5} {r['n']:>5} {r['gemms'] * 1e3:>8.2f} "
              f"{r['fused'] * 1e3:>8.2f} {r['flash'] * 1e3:>8.2f} {r['fused'] / r['gemms']:>8.2f} "
              f"{r['flash'] / r['gemms']:>8.2f} {r['fused pytorch'] / r['gemms']:>8.2f} {r['peak']:>9.2f} "
              + (f"{r['kernels'] / r['gemms']:>8.2f} {r['kernels peak']:>9.2f}" if "kernels" in r else ""))
    fused_over_gemms = sum(r["fused"] for r in rows) / sum(r["gemms"] for r in rows)
    flash_over_gemms = sum(r["flash"] for r in rows) / sum(r["gemms"] for r in rows)
    worst = max(r["flash"] / r["gemms"] for r in rows)
    launches = launch_counts(options.tokens, dtype)
    print(f"\nlaunches of one forward + backward at {largest_ffn_shape()[0]} (Triton + torch kernels):")
    for r in launches:
        print(f"{r['norm']:<13} " + ", ".join(f"{name} {r[name]['triton']} + {r[name]['torch']}"
                                              for name in ("flash", "kernels", "fused")))
    tiles = tiles_sweep(options.tokens, dtype, options.repeats) if options.tiles_sweep else None
    if tiles:
        print("\nflash's kernels by tiles (rows x tokens x step x output width; l2_norm_gelu; * = TILES'; blocks: "
              "flash's blocks of rows, Triton tiles):")
        print(f"{'layer':<14} {'tiles':>16} {'warps':>5} {'flash/G':>8} {'peak MiB':>9}")
        for r in tiles:
            print(f"{r['name']:<14} {r['tiles']:>15}{'*' if r['default'] else ' '} {r['warps'] or '-':>5} "
                  f"{r['over_gemms']:>8.2f} {r['peak_mib']:>9.0f}")
    sweep = blocks_sweep(options.tokens, dtype, options.repeats) if options.blocks_sweep else None
    if sweep:
        print(f"\nflash by blocks of the {options.tokens} input rows (BLOCKS; softmax; * = flash's own):")
        print(f"{'layer':<14} {'blocks':>7} {'rows':>6} {'flash/G':>8} {'peak MiB':>9}")
        for r in sweep:
            print(f"{r['name']:<14} {r['blocks']:>6}{'*' if r['default'] else ' '} {r['rows']:>6} "
                  f"{r['over_gemms']:>8.2f} {r['peak_mib']:>9.0f}")
    profiled = kernel_profile("l2_norm_gelu", largest_ffn_shape(), options.tokens, dtype) \
        if options.profile else None
    if profiled:
        print(profiled)
    if options.json:
        with open(options.json, "w", encoding="utf-8") as stream:
            json.dump({"tokens": options.tokens, "dtype": options.dtype, "kernels": rows,
                       "flash_over_gemms": flash_over_gemms, "fused_over_gemms": fused_over_gemms,
                       "worst": worst, "launches": launches, "tiles_sweep": tiles, "blocks_sweep": sweep,
                       "profile": profiled}, stream, indent=1)
    if options.no_steps:
        print(f"ratio: flash (Triton) Pattention time / six GEMMs = {flash_over_gemms:.2f} (all shapes and Θ; worst "
              f"{worst:.2f}); fused {fused_over_gemms:.2f}")
        return

    peak = options.peak_tflops * 1e12 if options.peak_tflops else matmul_peak_flops(options.repeats)
    configs = options.configs or list(PAPER_CONFIGS)
    print(f"\nTraining steps: {options.layers} layers, seq 2048, batch {options.batch}, bf16, AdamW; peak "
          f"{peak / 1e12:.0f} TFLOP/s ({'given' if options.peak_tflops else 'measured bf16 matmul'})")
    header = (f"{'config':<7} {'d':>5} {'flash tok/s':>12} {'fused tok/s':>12} {'flash MFU':>10} {'fused MFU':>10}")
    print(header)
    print("-" * len(header))
    steps = {}
    for name in configs:
        r = steps[name] = step_row(name, options.layers, options.batch, options.repeats, peak)
        if r.get("oom"):
            print(f"{name:<7} {r['d']:>5} out of memory at batch {options.batch}: lower --batch", flush=True)
            continue
        print(f"{name:<7} {r['d']:>5} {r['flash tokens/s']:>12,.0f} {r['fused tokens/s']:>12,.0f} "
              f"{r['flash mfu']:>10.1%} {r['fused mfu']:>10.1%}", flush=True)
    last = steps[configs[-1]]
    mfu = ("out of memory" if last.get("oom")
           else f"flash {last['flash mfu']:.1%}, fused {last['fused mfu']:.1%}")
    print(f"ratio: flash (Triton) Pattention time / six GEMMs = {flash_over_gemms:.2f} (all shapes and Θ; worst "
          f"{worst:.2f}); training-step MFU at {configs[-1]}: {mfu}")


if __name__ == "__main__":
    main()

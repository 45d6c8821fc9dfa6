"""Pattention forward+backward time vs its six GEMMs alone, and activation memory: plain, fused and flash.

    .venv/bin/python -m benchmarks.pattention [--tokens 1024] [--repeats 5] [--threads N] [--clock wall|cpu]
        [--baseline OTHER_VERSION/megatron/model/pattention/fused.py] [--proxy-only]

Shapes are the Pattention layers of the paper configs CPU_CONFIGS (width d, n parameter tokens) for `--tokens`
input tokens (a micro-batch slice that fits this CPU); "×3" is attention's Q, K and V run as one fused node.
The GEMM-only baseline runs exactly the six matrix products a Pattention needs (forward X·Kᵀ and S·V;
backward dY·Vᵀ, Sᵀ·dY, dA·K and dAᵀ·X) with no normalisation: the limit any implementation can reach.
The variants alternate and each keeps its fastest run (benchmarks/timing.py); flash is the blockwise
PyTorch path (megatron/model/pattention/flash.py; its Triton kernels need a GPU to be timed).
Memory (benchmarks/activation_memory.py): "saved" is what autograd keeps from forward to backward,
"peak" the most bytes held at once during forward + backward; "f/p" is fused / plain, "fl/f" flash /
fused. "non-G" is the profiler's self time of the fused run's operators other than matrix products over
the products' (a ratio within one run, so steadier under load than the timings). The last lines give
the fused and flash times over the GEMMs' summed over all shapes and Θ (and the worst single one), the
worst memory ratios, and flash's worst peak / fused at n ≥ 4d (the FFN shapes).

First, the host proxy (issue 40: on a GPU flash waited on the host): one Pattention's forward + backward at a
small shape (d = 64, n = 256, where compute is negligible and a call costs its host work), flash (PyTorch tiles)
against fused, at three token counts: flash's MIN_ROWS on a CPU (one block), BLOCKS full blocks, and four times
that many tokens (BLOCKS blocks again). "launches" is the number of aten operators torch.profiler records in
one call (each a kernel launch on a GPU unless it is a view): flash's must be the same at the last two token
counts. "host" is the call's time in ms (fastest of the alternating runs). With --proxy-only the proxy is all
that runs, and its last line gives flash / fused host time at one block (the worst Θ) and flash's launches at
the two larger token counts.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.activation_memory import peak_activation_bytes, saved_activation_bytes
from benchmarks.timing import add_arguments, fastest
from megatron.cli import positive_int
from megatron.model.pattention import flash as flash_module
from megatron.model.pattention import pattention, pattentions_function
from megatron.model.pattention.fused import fused_pattentions
from megatron.model.spec import layer_pattentions

NORM_TYPES = ("l2_norm_gelu", "gelu_l2_norm", "softmax")
CPU_CONFIGS = ("150M", "450M")  # the paper configs whose Pattentions this CPU times


def config_shapes(config: str) -> list[tuple[str, int, int, int]]:
    """(name, d, n, Pattentions of one input) for the Pattentions megatron/model/spec.py declares, at paper config
    `config`'s sizes: those under one module with one token-count key read one input and run as one node
    (attention's Q, K and V: "×3")."""
    from benchmarks.paper_configs import paper_args

    args = paper_args(config)
    groups = Counter((spec.path.rpartition(".")[0], spec.slot_key) for spec in layer_pattentions())
    return [(f"{config} {slot_key.removesuffix('_slot_num')}" + (f" ×{count}" if count > 1 else ""),
             args.hidden_size, getattr(args, slot_key), count) for (_, slot_key), count in groups.items()]


def shapes(configs: tuple[str, ...] = CPU_CONFIGS) -> list[tuple[str, int, int, int]]:
    """config_shapes of each of `configs`."""
    return [shape for config in configs for shape in config_shapes(config)]


def tensors(tokens: int, d: int, n: int, count: int) -> tuple[torch.Tensor, list, list, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d, generator=g).requires_grad_()
    keys = [(torch.randn(n, d, generator=g) * 0.02).requires_grad_() for _ in range(count)]
    values = [(torch.randn(n, d, generator=g) * 0.02).requires_grad_() for _ in range(count)]
    return x, keys, values, torch.randn(count, tokens, d, generator=g)


def gemms_only(x, keys, values, grad_out) -> None:
    with torch.no_grad():
        for key, value, grad in zip(keys, values, grad_out):
            scores = x @ key.t()
            scores @ value
            grad_scores = grad @ value.t()
            scores.t() @ grad
            grad_scores @ key
            grad_scores.t() @ x


def plain(x, keys, values, norm_type):
    return torch.stack([pattention(x, k, v, norm_type, 1.0, k.shape[0]) for k, v in zip(keys, values)])


def fused(x, keys, values, norm_type):
    return fused_pattentions(x, keys, values, norm_type, 1.0, [k.shape[0] for k in keys])


def flash(x, keys, values, norm_type):
    return pattentions_function("flash", "pytorch")(x, keys, values, norm_type, 1.0, [k.shape[0] for k in keys])


def load_baseline(path: Path) -> Callable:
    """The `fused_pattention` of another version's fused Pattention file (megatron/model/pattention/fused.py, before
    the subpackage megatron/model/pattention.py; e.g. before a change), as `plain` is called."""
    spec = importlib.util.spec_from_file_location("baseline_pattention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def baseline(x, keys, values, norm_type):
        return torch.stack([module.fused_pattention(x, k, v, norm_type, 1.0, k.shape[0]) for k, v in zip(keys, values)])
    return baseline


def forward_backward(fn, x, keys, values, norm_type, grad_out) -> Callable[[], None]:
    def step() -> None:
        fn(x, keys, values, norm_type).backward(grad_out)
    return step


def clear_grads(*tensors: torch.Tensor) -> None:
    for t in tensors:
        t.grad = None


GEMM_OPERATORS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_"}


def non_gemm_share(step: Callable[[], None], runs: int = 3) -> float:
    """Profiler self time of every operator but the matrix products, over the products' (least of `runs`):
    where a Pattention's time goes besides its GEMMs, measured within one run and so robust to load."""
    shares = []
    for _ in range(runs):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        times = {event.key: event.self_cpu_time_total for event in prof.key_averages()}
        gemm = sum(t for name, t in times.items() if name in GEMM_OPERATORS)
        shares.append((sum(times.values()) - gemm) / gemm)
    return min(shares)


def memory_ratios(x, keys, values, norm_type, grad_out) -> tuple[float, float, float, float]:
    """Activation bytes: saved fused/plain, peak fused/plain, saved flash/fused, peak flash/fused."""
    params = (x, *keys, *values)
    saved, peak = {}, {}
    for fn in (plain, fused, flash):
        saved[fn] = saved_activation_bytes(lambda fn=fn: fn(x, keys, values, norm_type), exclude=params)
        clear_grads(*params)
        peak[fn] = peak_activation_bytes(forward_backward(fn, x, keys, values, norm_type, grad_out), params)
    return (saved[fused] / saved[plain], peak[fused] / peak[plain], saved[flash] / saved[fused],
            peak[flash] / peak[fused])


def aten_operators(step: Callable[[], None]) -> int:
    """The aten operators torch.profiler records in one call of `step` (after a warm-up call): what the host
    dispatches, a kernel launch each on a GPU unless it is a view."""
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(event.count for event in prof.key_averages() if event.key.startswith("aten::"))


PROXY_SHAPE = (64, 256)  # d, n


def proxy_token_counts() -> tuple[int, int, int]:
    """One flash block on a CPU, BLOCKS full blocks, and four times as many tokens."""
    device = torch.device("cpu")
    full = flash_module.BLOCKS["cpu"] * flash_module.MIN_ROWS["cpu"]
    counts = (flash_module.MIN_ROWS["cpu"], full, 4 * full)
    assert [len(flash_module.row_blocks(t, device)) for t in counts] == [1, *[flash_module.BLOCKS["cpu"]] * 2], counts
    return counts


def host_proxy(repeats: int, clock: str) -> list[dict]:
    """Flash (PyTorch tiles) and fused at PROXY_SHAPE, every Θ, each of proxy_token_counts(): flash's blocks, the
    aten operators of one forward + backward of each, and each one's fastest time (s)."""
    d, n = PROXY_SHAPE
    rows = []
    for norm_type in NORM_TYPES:
        for tokens in proxy_token_counts():
            x, keys, values, grad_out = tensors(tokens, d, n, 1)
            steps = {"flash": forward_backward(flash, x, keys, values, norm_type, grad_out),
                     "fused": forward_backward(fused, x, keys, values, norm_type, grad_out)}
            launches = {name: aten_operators(step) for name, step in steps.items()}
            times = fastest(steps, repeats, clock)
            rows.append({"norm": norm_type, "tokens": tokens, "blocks": len(flash_module.row_blocks(tokens, x.device)),
                         **{f"{name} launches": launches[name] for name in steps},
                         **{f"{name} host": times[name] for name in steps}})
    return rows


def print_host_proxy(rows: list[dict]) -> str:
    """Prints the proxy's table; returns its summary (the --proxy-only ratio line, without "ratio: ")."""
    d, n = PROXY_SHAPE
    print(f"host proxy: one Pattention forward + backward at d={d}, n={n} (ms; launches = aten operators a call)")
    header = (f"{'Θ':<13} {'tokens':>6} {'blocks':>6} {'flash launches':>14} {'fused launches':>14} "
              f"{'flash host':>10} {'fused host':>10} {'flash/fused host':>16}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['norm']:<13} {r['tokens']:>6} {r['blocks']:>6} {r['flash launches']:>14} "
              f"{r['fused launches']:>14} {r['flash host'] * 1e3:>10.2f} {r['fused host'] * 1e3:>10.2f} "
              f"{r['flash host'] / r['fused host']:>16.2f}")
    one, full, more = proxy_token_counts()
    worst = max(r["flash host"] / r["fused host"] for r in rows if r["tokens"] == one)
    launches = {t: max(r["flash launches"] for r in rows if r["tokens"] == t) for t in (full, more)}
    return (f"flash / fused host time at {one} tokens (one block) = {worst:.2f} (worst Θ); flash launches at "
            f"{full} and {more} tokens ({flash_module.BLOCKS['cpu']} blocks each) = {launches[full]} and "
            f"{launches[more]} (most of any Θ)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=positive_int, default=1024, help="input tokens of each layer's timing")
    parser.add_argument("--baseline", type=Path, help="another version's megatron/model/pattention/fused.py "
                        "(before the subpackage: megatron/model/pattention.py): its fused_pattention is timed too, "
                        "alternating with the others (column base/G)")
    parser.add_argument("--proxy-only", action="store_true", help="run only the host proxy (seconds)")
    add_arguments(parser)
    args = parser.parse_args()
    baseline = load_baseline(args.baseline) if args.baseline else None
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads} fp32; fastest of {args.repeats} alternating runs ({args.clock} clock)")
    proxy = print_host_proxy(host_proxy(args.repeats, args.clock))
    if args.proxy_only:
        print(f"ratio: {proxy}")
        return
    print(f"host proxy: {proxy}\n")
    print(f"threads={args.threads} tokens={args.tokens} fp32; fastest of {args.repeats} alternating runs "
          f"({args.clock} clock, ms)")
    header = (f"{'Θ':<13} {'layer':<14} {'d':>5} {'n':>5} {'GEMMs':>8} {'plain':>8} {'fused':>8} {'flash':>8} "
              f"{'plain/G':>8} {'fused/G':>8} {'flash/G':>8} {'non-G':>6} {'saved f/p':>10} {'peak f/p':>9} "
              f"{'saved fl/f':>10} {'peak fl/f':>9}" + (f" {'base/G':>7}" if baseline else ""))
    print(header)
    print("-" * len(header))
    total = {"gemms": 0.0, "fused": 0.0, "flash": 0.0}
    worst = {"time": 0.0, "flash time": 0.0, "saved": 0.0, "peak": 0.0, "flash peak n>=4d": 0.0}
    for norm_type in NORM_TYPES:
        for name, d, n, count in shapes():
            x, keys, values, grad_out = tensors(args.tokens, d, n, count)
            fused_step = forward_backward(fused, x, keys, values, norm_type, grad_out)
            steps = {"gemms": lambda: gemms_only(x, keys, values, grad_out),
                     "plain": forward_backward(plain, x, keys, values, norm_type, grad_out), "fused": fused_step,
                     "flash": forward_backward(flash, x, keys, values, norm_type, grad_out)}
            if baseline:
                steps["base"] = forward_backward(baseline, x, keys, values, norm_type, grad_out)
            times = fastest(steps, args.repeats, args.clock)
            share = non_gemm_share(fused_step)
            saved, peak, flash_saved, flash_peak = memory_ratios(x, keys, values, norm_type, grad_out)
            gemm = times["gemms"]
            total = {key: total[key] + times[key] for key in total}
            worst = {"time": max(worst["time"], times["fused"] / gemm),
                     "flash time": max(worst["flash time"], times["flash"] / gemm),
                     "saved": max(worst["saved"], saved), "peak": max(worst["peak"], peak),
                     "flash peak n>=4d": max(worst["flash peak n>=4d"], flash_peak if n >= 4 * d else 0.0)}
            print(f"{norm_type:<13} {name:<14} {d:>5} {n:>5} {gemm * 1e3:>8.1f} {times['plain'] * 1e3:>8.1f} "
                  f"{times['fused'] * 1e3:>8.1f} {times['flash'] * 1e3:>8.1f} {times['plain'] / gemm:>8.2f} "
                  f"{times['fused'] / gemm:>8.2f} {times['flash'] / gemm:>8.2f} {share:>6.2f} {saved:>10.2f} "
                  f"{peak:>9.2f} {flash_saved:>10.2f} {flash_peak:>9.2f}"
                  + (f" {times['base'] / gemm:>7.2f}" if baseline else ""), flush=True)
    print(f"fused Pattention time / six GEMMs = {total['fused'] / total['gemms']:.2f} (all shapes and Θ; worst one "
          f"{worst['time']:.2f}); activation memory fused / plain: saved {worst['saved']:.2f}, peak "
          f"{worst['peak']:.2f} (worst)")
    print(f"ratio: flash Pattention time / six GEMMs = {total['flash'] / total['gemms']:.2f} (worst one "
          f"{worst['flash time']:.2f}); peak activation memory flash / fused at n >= 4d = "
          f"{worst['flash peak n>=4d']:.2f} (worst)")


if __name__ == "__main__":
    main()

"""The tables benchmarks/framework_step.py prints: the variants' speed, their steps by phase, the costliest operators
where the framework adds work, the decision table of its levers, and the final ratio line."""

from __future__ import annotations

import statistics
from dataclasses import asdict

from megatron.training.phases import BOOKKEEPING, DATA, GRADIENT_REDUCTION, LOSS, LOSS_READOUT, OPTIMIZER

FRAMEWORK = "framework"  # deepy.py's step as configs/1-5B.yml runs it
FRAMEWORK_DP, DDP = "framework-dp2", "ddp"  # the same at DP 2, and its peer: torch DDP's loop
PEERS = ("plain+masters", "plain")  # the fair peer first (issue 47): the same recipe in a plain loop
# A lever's variants: (on, off); a ratio within NOISE of 1 is a tie.
LEVERS = {
    "lean_step": ("framework", "framework-deepspeed"),
    "compile.enable": ("framework+compile", "framework"),
    "pipe_parallel_size 0 (DeepSpeed's step)": ("framework-deepspeed-pp0", "framework-deepspeed"),
    "lean_step at DP 2": ("framework-dp2", "framework-deepspeed-dp2"),
}
NOISE = 0.01


def summarise(results: dict, flops: tuple[int, int], peak: tuple[float, str]) -> dict[str, dict]:
    """Per variant: tokens/s, TFLOP/s, MFU, HFU (recomputation counted), its ratios to the peers, and its run."""
    rates = {name: r.tokens_per_step / r.step_seconds for name, r in results.items()}
    summary = {}
    for name, r in results.items():
        hardware = flops[1] if name.endswith("+recompute") else flops[0]
        summary[name] = {"tokens_per_sec": rates[name], "tflops": rates[name] * flops[0] / 1e12,
                         "mfu": rates[name] * flops[0] / peak[0], "hfu": rates[name] * hardware / peak[0],
                         **{f"ratio_to_{peer}": rates[name] / rates[peer] for peer in PEERS if peer in rates},
                         **asdict(r)}
    return summary


def decisions(summary: dict[str, dict]) -> list[dict]:
    """Each lever both of whose variants ran: its tokens/s on and off, which wins, by how much."""
    rows = []
    for lever, (on, off) in LEVERS.items():
        if on in summary and off in summary:
            ratio = summary[on]["tokens_per_sec"] / summary[off]["tokens_per_sec"]
            winner = "tie" if abs(ratio - 1) <= NOISE else ("on" if ratio > 1 else "off")
            rows.append({"lever": lever, "on": on, "off": off, "on_tokens_per_sec": summary[on]["tokens_per_sec"],
                         "off_tokens_per_sec": summary[off]["tokens_per_sec"], "on_over_off": ratio,
                         "winner": winner})
    return rows


def print_tables(results: dict, flops: tuple[int, int], peak: tuple[float, str], on_device: bool) -> dict:
    summary = summarise(results, flops, peak)
    print(f"MFU over {peak[1]}; FLOPs/token {flops[0]:,} (megatron/model/flops.py, no recomputation; HFU counts "
          f"the recomputed forward too, {flops[1]:,})")
    peer = next((p for p in PEERS if p in summary), None)
    header = (f"{'variant':<24} {'params':>9} {'ms/step':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'HFU':>6} "
              f"{'peak GiB':>9} {'reserved':>9} {'retries':>8} {'/ ' + (peer or '-'):>15}")
    print(header)
    print("-" * len(header))
    for name, s in summary.items():
        gib = lambda value: "-" if value is None else f"{value / 2**30:.1f}"  # noqa: E731
        ratio = s.get(f"ratio_to_{peer}")
        print(f"{name:<24} {s['parameters'] / 1e6:>8.1f}M {s['step_seconds'] * 1e3:>9.1f} "
              f"{s['tokens_per_sec']:>10,.0f} {s['tflops']:>8.3g} {s['mfu']:>6.1%} {s['hfu']:>6.1%} "
              f"{gib(s['peak_memory_bytes']):>9} {gib(s['peak_reserved_bytes']):>9} "
              f"{'-' if s['allocator_retries'] is None else s['allocator_retries']:>8} "
              f"{'-' if ratio is None else format(ratio, '.3f'):>15}")
    print_losses(summary)
    print_breakdown(results, on_device)
    rows = decisions(summary)
    if rows:
        print(f"\ndecision table (tokens/s with the lever on / off; within {NOISE:.0%}: a tie)")
        for row in rows:
            print(f"  {row['lever']:<42} on {row['on_tokens_per_sec']:>10,.0f}  off {row['off_tokens_per_sec']:>10,.0f}"
                  f"  on/off {row['on_over_off']:.3f}  wins: {row['winner']}")
    print_reduction_overlap(results)
    if FRAMEWORK_DP in summary and DDP in summary:
        print(f"ratio at DP 2: framework-dp2 (deepy.py's step) tokens/s / ddp tokens/s = "
              f"{summary[FRAMEWORK_DP]['tokens_per_sec'] / summary[DDP]['tokens_per_sec']:.3f}")
    if FRAMEWORK in summary and peer:
        beside = "" if peer == "plain" or "plain" not in summary else (
            f" (/ plain: {summary[FRAMEWORK]['ratio_to_plain']:.3f})")
        print(f"ratio: framework (deepy.py's step) tokens/s / {peer} tokens/s = "
              f"{summary[FRAMEWORK][f'ratio_to_{peer}']:.3f}{beside}")
    return {"variants": summary, "decisions": rows}


def print_reduction_overlap(results: dict) -> None:
    """Each DP variant of the lean step: the wait on the gradient reduction left after backward (its phase in the
    profiled steps), against the all-reduce of the whole gradient buffer alone: what backward hid."""
    for name, r in results.items():
        if r.reduction_seconds is not None and GRADIENT_REDUCTION in r.breakdown:
            waited = r.breakdown[GRADIENT_REDUCTION]["host_ms"]
            print(f"\n{name}: waited {waited:.1f} ms a step on the gradient reduction after backward; the reduction "
                  f"alone takes {r.reduction_seconds * 1e3:.1f} ms")


def print_losses(summary: dict[str, dict]) -> None:
    """Each variant's losses over its steps (the same batches from the same loader): the first, the last, and the
    largest relative difference to the framework's."""
    reference = summary.get(FRAMEWORK, {}).get("losses")
    print("\nlosses over the same batches: first, last, max relative difference to framework's")
    for name, s in summary.items():
        losses = s["losses"]
        if not losses:
            continue
        gap = "-" if not reference or len(reference) != len(losses) else format(
            max(abs(a - b) / abs(b) for a, b in zip(losses, reference)), ".2e")
        print(f"  {name:<24} {losses[0]:.5f} {losses[-1]:.5f} {gap}")


def print_breakdown(results: dict, on_device: bool) -> None:
    profiled = {name: r for name, r in results.items() if r.breakdown}
    if not profiled:
        return
    print("\nper step, by phase (megatron/training/phases.py): host ms / device ms / operators / host syncs")
    phases = list(dict.fromkeys(p for r in profiled.values() for p in r.breakdown))
    print(f"{'phase':<28}" + "".join(f"{name:>30}" for name in profiled))
    for phase_name in phases:
        cells = []
        for r in profiled.values():
            c = r.breakdown.get(phase_name)
            cells.append("-" if c is None else
                         f"{c['host_ms']:.1f} / {c['device_ms']:.1f} / {c['ops']:.0f} / {c['syncs']:.0f}")
        print(f"{phase_name.removeprefix('phase: '):<28}" + "".join(f"{cell:>30}" for cell in cells))
    totals = []
    for r in profiled.values():
        device = sum(c["device_ms"] for c in r.breakdown.values())
        idle = f", device idle {max(0.0, r.step_seconds * 1e3 - device):.1f}" if device else ""
        totals.append(f"syncs {sum(c['syncs'] for c in r.breakdown.values()):.0f}{idle}")
    print(f"{'total':<28}" + "".join(f"{t:>30}" for t in totals))
    print_top_operators(profiled, on_device)


def print_top_operators(profiled: dict, on_device: bool, count: int = 4) -> None:
    """Each variant's costliest operators in the phases where the framework adds work to the plain loop."""
    unit = "device" if on_device else "host"
    print(f"\ncostliest operators per step ({unit} ms, calls), in the phases the plain loop keeps small")
    for name, r in profiled.items():
        for phase_name in (LOSS, GRADIENT_REDUCTION, OPTIMIZER, LOSS_READOUT, BOOKKEEPING, DATA):
            operators = r.breakdown.get(phase_name, {}).get("operators", {})
            top = sorted(operators.items(), key=lambda item: -item[1][2 if on_device else 1])[:count]
            if top:
                listed = ", ".join(f"{op} {values[2 if on_device else 1]:.2f} ({values[0]:.0f})"
                                   for op, values in top)
                print(f"  {name:<24} {phase_name.removeprefix('phase: '):<31} {listed}")


def median_round(rounds: list):
    """The round whose step time is the median of a variant's rounds (the lower of the two middle ones)."""
    ordered = sorted(rounds, key=lambda r: r.step_seconds)
    middle = statistics.median_low([r.step_seconds for r in ordered])
    return next(r for r in ordered if r.step_seconds == middle)

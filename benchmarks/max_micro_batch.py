"""The largest micro-batch of a paper config that trains on this GPU, flash against fused, measured and as the
memory model (megatron/model/memory.py) predicts it.

    python -m benchmarks.max_micro_batch [--config 1-5B] [--layers L] [--max 64] [--json FILE]

The model is the config at full width, vocabulary and (unless --layers) depth, in bf16 on the device, sequences
of its seq_length, no activation checkpointing; beside it the optimizer states a one-GPU ZeRO-1 run holds (fp32
master weights and Adam's two moments, 12 bytes a parameter) are allocated, so that the device holds what the
memory model's max_micro_batch counts at data-parallel size 1. A micro-batch fits when its forward, lm_loss and
backward run without running out of device memory; the search doubles until one does not, then bisects. The
prediction is max_micro_batch with no reserve (everything the formula counts) and with its usual 10 %. The
allocator is set up as a training rank's (megatron/runtime/entry.py: expandable segments).

Needs a CUDA device: without one it says so on one line and exits 2 (nothing measured).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch

UNAVAILABLE_EXIT = 2


def largest_that_fits(fits: Callable[[int], bool], limit: int) -> int:
    """The largest b in [1, limit] with fits(b), assuming fits is monotone (0 if even 1 does not fit): doubling,
    then bisection between the last batch that fit and the first that did not."""
    good, bad = 0, None
    batch = 1
    while batch <= limit:
        if not fits(batch):
            bad = batch
            break
        good, batch = batch, batch * 2
    if bad is None:
        bad = limit + 1
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def measure(config: str, layers: int | None, impl: str, limit: int) -> dict:
    """Search one implementation: its largest fitting micro-batch and the peak bytes allocated at it."""
    from benchmarks.paper_configs import paper_args
    from megatron.model import TokenFormerModel
    from megatron.model.memory import max_micro_batch, model_state_bytes, parameter_count, peak_activation_bytes
    from megatron.training.step import lm_loss

    overrides = {"num_layers": layers} if layers else {}
    args = paper_args(config, checkpoint_activations=False, pattention_impl=impl, flash_backend="auto", **overrides)
    device = torch.device("cuda")
    model = TokenFormerModel(args, device=device).to(torch.bfloat16)
    params = parameter_count(args)
    _optimizer_states = torch.empty(3 * params, dtype=torch.float32, device=device)  # master, m, v
    peaks: dict[int, int] = {}

    def fits(batch: int) -> bool:
        tokens = None
        try:
            torch.cuda.reset_peak_memory_stats()
            tokens = torch.randint(0, args.padded_vocab_size, (batch, args.seq_length + 1), device=device)
            lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            torch.cuda.synchronize()
            peaks[batch] = torch.cuda.max_memory_allocated()
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            del tokens
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    largest = largest_that_fits(fits, limit)
    total = torch.cuda.get_device_properties(device).total_memory
    predicted = {f"reserve {reserve:g}": max_micro_batch(args, impl, False, total, reserve, data_parallel=1)
                 for reserve in (0.0, 0.1)}
    formula_peak = (model_state_bytes(params, 1)
                    + peak_activation_bytes(args, impl, torch.bfloat16, largest, False)) if largest else None
    return {"impl": impl, "largest": largest, "predicted": predicted, "measured_peak_bytes": peaks.get(largest),
            "formula_peak_bytes": formula_peak, "device_bytes": total, "layers": args.num_layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="1-5B")
    parser.add_argument("--layers", type=int, default=None, help="depth (default: the config's)")
    parser.add_argument("--max", type=int, default=64, help="largest micro-batch tried")
    parser.add_argument("--json", default=None, help="also write the results here")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.max_micro_batch: needs a CUDA device (torch.cuda.is_available() is False); nothing "
              "measured", file=sys.stderr)
        sys.exit(UNAVAILABLE_EXIT)
    from megatron.runtime.entry import use_training_allocator

    use_training_allocator("cuda")  # before the first device call: measured with the allocator training uses
    rows = []
    for impl in ("fused", "flash"):
        rows.append(measure(options.config, options.layers, impl, options.max))
        torch.cuda.empty_cache()  # the model and states measure() held, freed as it returned, go back to the card
    print(f"{options.config}, {rows[0]['layers']} layers, bf16, no checkpointing, one GPU "
          f"({rows[0]['device_bytes'] / 2**30:.0f} GiB) with ZeRO-1 states at data-parallel size 1")
    header = f"{'impl':<6} {'largest':>8} {'predicted (0 / 10% reserve)':>28} {'peak GiB':>9} {'formula GiB':>12}"
    print(header)
    print("-" * len(header))
    for r in rows:
        predicted = " / ".join(str(v) for v in r["predicted"].values())
        peak = "-" if r["measured_peak_bytes"] is None else f"{r['measured_peak_bytes'] / 2**30:.1f}"
        formula = "-" if r["formula_peak_bytes"] is None else f"{r['formula_peak_bytes'] / 2**30:.1f}"
        print(f"{r['impl']:<6} {r['largest']:>8} {predicted:>28} {peak:>9} {formula:>12}")
    fused, flash = rows
    ratio = flash["largest"] / fused["largest"] if fused["largest"] else float("inf")
    print(f"ratio: largest micro-batch flash / fused = {ratio:.2f} ({flash['largest']} / {fused['largest']})")
    if options.json:
        with open(options.json, "w", encoding="utf-8") as stream:
            json.dump({"config": options.config, "rows": rows, "ratio": ratio}, stream, indent=1)


if __name__ == "__main__":
    main()

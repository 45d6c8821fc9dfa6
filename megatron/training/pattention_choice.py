"""pattention_impl: auto, decided once per run from the memory model (megatron/model/memory.py).

fused keeps one [tokens, n] score matrix per Pattention and is the faster one wherever memory does not bind;
flash keeps O(tokens) per Pattention and recomputes the scores, so it fits a larger micro-batch at a cost in time
(figures: benchmarks/RESULTS.md). So auto takes fused unless the memory model says a training step of the
configured micro-batch would not fit the device with fused, and flash then. Where the memory model has no
estimate (attention dropout), auto takes fused and says why.

The estimate per rank is megatron/model/rank_memory.py's. A tenth of the device is left for what the formula
leaves out (fragmentation, workspaces, communication buckets, backward's transients).
"""

from __future__ import annotations

from megatron.model.args import TokenFormerArgs
from megatron.model.memory import GIB, NotModelled
from megatron.model.rank_memory import RunShape, training_bytes_per_rank
from megatron.runtime.environment import local_process_count

RESERVE = 0.10


def choose_pattention_impl(args: TokenFormerArgs, shape: RunShape, device_type: str,
                           device_bytes: int) -> tuple[str, str]:
    """("fused" or "flash", the reason in one line) for a run of `shape` on a device of `device_bytes`."""
    budget = (1 - RESERVE) * device_bytes
    try:
        fused = training_bytes_per_rank(args, "fused", shape, device_type)
    except NotModelled as reason:
        return "fused", f"{reason}: fused, the faster where memory does not bind (pattention_impl: flash keeps less)"
    where = f"micro-batch {shape.micro_batch}, {device_bytes / GIB:.1f} GiB per rank, {RESERVE:.0%} kept free"
    if fused <= budget:
        return "fused", (f"fused fits ({fused / GIB:.1f} GiB by the memory model; {where}) and is faster where "
                         "memory does not bind")
    flash = training_bytes_per_rank(args, "flash", shape, device_type)
    return "flash", (f"fused would need {fused / GIB:.1f} GiB, flash {flash / GIB:.1f} GiB ({where}); flash "
                     "keeps no [tokens x n] scores")


def resolve_pattention_impl(cfg, args: TokenFormerArgs, accelerator) -> tuple[str, str | None]:
    """The config's pattention_impl, with auto decided for this run's shape and device: (impl, why auto chose it,
    or None when the config named one)."""
    if cfg.pattention_impl != "auto":
        return cfg.pattention_impl, None
    if args.model_type == "transformer":
        return "fused", "model_type transformer has no Pattentions: the choice has no effect"
    return choose_pattention_impl(args, RunShape.from_config(cfg), accelerator.device_name(),
                                  device_bytes_per_rank(accelerator))


def device_bytes_per_rank(accelerator) -> int:
    """Memory one rank may use: its device's on an accelerator; on a CPU, the machine's shared by the ranks on
    it (runtime/environment.py local_process_count)."""
    total = int(accelerator.total_memory())
    if accelerator.device_name() != "cpu":
        return total
    return total // local_process_count()

"""`norm_token_count_ramp_iters`: after a growth that kept the old n of Θ's √n (preserve), move each Pattention's
n to its token count over the stage's first iterations.

preserve growth keeps the function by keeping the source's n; official growth normalises by the new count n' at
once, which changes the function. The ramp does both: at the growth's iteration every Pattention normalises by
the n its grown checkpoint holds (the function is the source's, exactly), and `ramp` iterations later by its own
token count, as a model of its size from scratch; in between n moves linearly, rounded to a whole count (the
buffer is an integer). Where it starts and when come from the growth record (checkpoint/growth_record.py:
`norm_token_count`, `iteration`), so a run resumed halfway continues the same ramp; one resumed with another ramp
length, which would move n at once, or with none, which would hold n between the two counts for good, is refused
with the fix (`resumed_ramp_problem`): the config says the ramp, as everywhere else, and the error names it. The
counts are set on the host, once per change of the whole count (after each step, so that a checkpoint saved at an
iteration holds the n the ramp gives it): no synchronisation, and no work on the iterations in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import Tensor, nn

from megatron.checkpoint.commit import CHECKPOINT_TAG
from megatron.cli import InputError
from megatron.config import ConfigError
from megatron.formats.consolidated import CONFIG_NAME, read_config
from megatron.model.pattention import Pattention
from megatron.model.spec import pattention_of_module, slot_keys


def norm_buffers(model: nn.Module) -> dict[str, list[Tensor]]:
    """The norm_token_count buffers of `model`'s Pattentions (a TokenFormerModel or a pipeline stage), by slot key."""
    buffers: dict[str, list[Tensor]] = {}
    for name, module in model.named_modules():
        spec = pattention_of_module(name) if isinstance(module, Pattention) else None
        if spec is not None:
            buffers.setdefault(spec.slot_key, []).append(module.norm_token_count)
    return buffers


def norm_counts(model: nn.Module) -> dict[str, int]:
    """The n of √n each kind of Pattention of `model` holds (one value per slot key; ValueError if they differ)."""
    counts = {key: {int(buffer) for buffer in buffers} for key, buffers in norm_buffers(model).items()}
    mixed = {key: sorted(values) for key, values in counts.items() if len(values) > 1}
    if mixed:
        raise InputError(f"Pattentions of one kind normalise by different counts: {mixed}")
    return {key: values.pop() for key, values in counts.items()}


@dataclass(frozen=True)
class NormRamp:
    """n of √n per slot key: `start` at iteration `first`, `target` from `first + length` on, linear between."""

    start: dict[str, int]
    target: dict[str, int]
    first: int
    length: int

    def count(self, slot_key: str, iteration: int) -> int:
        share = min(max((iteration - self.first) / self.length, 0.0), 1.0)
        start, target = self.start[slot_key], self.target[slot_key]
        return round(start + (target - start) * share)


def resumed_ramp_problem(cfg, tag_dir: Path, record: dict | None) -> str | None:
    """Why resuming checkpoint `tag_dir` (global_stepN, growth record `record`) under `cfg` would break the ramp
    the run that saved it was on (its config.json): another length moves n of √n at once where the two ramps
    differ at its iteration; no ramp (0) mid-ramp would leave n between the two counts for good, neither the
    source's function nor the model's own. None otherwise (also where there is nothing to compare)."""
    tag, saved = CHECKPOINT_TAG.match(tag_dir.name), tag_dir / CONFIG_NAME
    if record is None or tag is None or not saved.is_file():
        return None
    iteration = int(tag.group(1))
    before, after = read_config(saved).norm_token_count_ramp_iters, cfg.norm_token_count_ramp_iters
    if before == after or "norm_token_count" not in record or "iteration" not in record:
        return None
    start, target = record["norm_token_count"], {key: getattr(cfg, key) for key in slot_keys()}
    if set(start) != set(target):
        return None  # norm_ramp names a record without a count for every slot key
    held = NormRamp(start, target, record["iteration"], before) if before else NormRamp(start, start, 0, 1)
    fix = f"set norm_token_count_ramp_iters: {before} to continue its ramp"
    if not after:
        between = [f"{key} {held.count(key, iteration)} (from {start[key]} to {target[key]})" for key in slot_keys()
                   if held.count(key, iteration) not in (start[key], target[key])]
        if not between:
            return None
        return (f"norm_token_count_ramp_iters 0: the checkpoint (iteration {iteration}) was saved midway through a "
                f"ramp of n of √n over {before} iterations, and without one n would stay where it is for good "
                f"({', '.join(between)}): neither the source's function nor the grown model's; {fix}")
    now = NormRamp(start, target, record["iteration"], after)
    jumps = [f"{key} {held.count(key, iteration)} -> {now.count(key, iteration)}" for key in slot_keys()
             if held.count(key, iteration) != now.count(key, iteration)]
    if not jumps:
        return None
    return (f"norm_token_count_ramp_iters {after}: the checkpoint (iteration {iteration}) was saved by a run with "
            f"norm_token_count_ramp_iters {before}, so n of √n would jump at the resume ({', '.join(jumps)}) and the "
            f"function with it; {fix}")


def norm_ramp(cfg, record: dict | None) -> NormRamp | None:
    """The run's ramp (None when norm_token_count_ramp_iters is 0); ConfigError when it cannot apply."""
    if not cfg.norm_token_count_ramp_iters:
        return None
    if record is None or "norm_token_count" not in record or "iteration" not in record:
        where = ("its growth record (growth.json) predates the ramp: grow the source again with this version of "
                 "tools/grow_checkpoint.py" if record is not None else "it was not grown")
        raise ConfigError(f"norm_token_count_ramp_iters {cfg.norm_token_count_ramp_iters} ramps n of √n from the "
                          f"count a grown checkpoint holds, but the checkpoint this run starts from cannot say it: "
                          f"{where}. Or set norm_token_count_ramp_iters: 0")
    start = record["norm_token_count"]
    missing = [key for key in slot_keys() if key not in start]
    if missing:
        raise ConfigError(f"norm_token_count_ramp_iters: the growth record has no norm_token_count for {missing}")
    return NormRamp(dict(start), {key: getattr(cfg, key) for key in slot_keys()}, record["iteration"],
                    cfg.norm_token_count_ramp_iters)


class NormRampApplier:
    """Sets the norm_token_count buffers of `model`'s Pattentions (a TokenFormerModel or a pipeline stage) as the
    ramp says for an iteration, writing only where the whole count changed."""

    def __init__(self, model: nn.Module, ramp: NormRamp) -> None:
        self.ramp = ramp
        self.buffers = norm_buffers(model)
        self.current: dict[str, int | None] = dict.fromkeys(self.buffers)

    def apply(self, iteration: int) -> None:
        for key, buffers in self.buffers.items():
            count = self.ramp.count(key, iteration)
            if count != self.current[key]:
                for buffer in buffers:
                    buffer.fill_(count)
                self.current[key] = count

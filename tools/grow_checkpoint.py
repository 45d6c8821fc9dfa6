"""Grow a checkpoint's parameter tokens and/or re-shard it into another parallel layout (docs/growth.md).

    python tools/grow_checkpoint.py --load CKPT_DIR [--tag global_stepN] --save NEW_DIR \\
        --config TARGET.yml [more.yml ...] [--qkv-slot-num N] [--proj-slot-num N] [--ffn-slot-num N] \\
        [--growth-mode preserve|official] [--norm-token-count old|new] [--reset-optimizer | --carry-optimizer] \
        [--zero-new-values] [--reset-iteration | --keep-iteration] [--allow-shrink]

TARGET.yml is the next stage's run config: its qkv_slot_num / proj_slot_num / ffn_slot_num (or the flags)
give the new token counts, its model_parallel_size / pipe_parallel_size the new layout, its seed the new
tokens, its growth_mode (or the flag) how they are made. Same counts and another layout re-shard only: the
weights, the n of √n, the optimizer state, the iteration and the growth record are kept, whatever the mode
(the optimizer state is dropped only where asked: --reset-optimizer, or the config's growth_optimizer: reset).
official (the default): as the official TokenFormer code, old rows copied into a fresh init of the larger
model (√n of the new count), optimizer state dropped and iteration 0. preserve: old tokens stay bit-exact, new
keys are zero and the normalisation keeps the old n, so the grown model computes the same function; the Adam
state is carried over (new tokens' moments zero) and the iteration and LR schedule continue. --norm-token-count
and --reset-optimizer / --carry-optimizer (or the config's growth_norm_token_count and growth_optimizer) change
one of these at a time, and --keep-iteration continues an official growth's iteration (as growth_schedule does
inside a run); docs/growth.md compares the modes. Train from NEW_DIR with `load: NEW_DIR` and the
target config; nothing else to set.

The source is only read; its files are checked against its manifest while growing, and nothing is published
unless they match. The output is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from megatron.cli import InputError, one_line_errors, stop_at_once_while_starting
from megatron.host.startup import collector_paused

if __name__ == "__main__":  # before the imports below, which are slow (megatron/cli.py)
    stop_at_once_while_starting("grow_checkpoint.py", "before anything was written")

with collector_paused():  # torch and DeepSpeed, imported below (megatron/host/startup.py)
    from megatron.checkpoint.commit import STAGING_PREFIX
    from megatron.checkpoint.output_directory import remove_interrupted_writes, require_new_or_empty
    from megatron.config import load_config
    from megatron.config.loader import keys_set
    from megatron.formats.deepspeed.reader import checkpoint_directory, read_checkpoint
    from megatron.growth.grow_checkpoint import write_grown_checkpoint
    from megatron.growth.plan import NORM_TOKEN_COUNTS, GrowthPlan
    from megatron.model.args import GROWTH_MODES
    from megatron.model.spec import slot_keys


def keep_freed_memory_for_reuse() -> bool:
    """Have glibc's malloc serve large blocks from its heap and keep freed ones there, so the next grown tensor
    of a size reuses memory the allocator itself knows is free, instead of a fresh mmap whose pages the kernel
    faults in and zeroes one by one (figures: benchmarks/RESULTS.md, "Growth"). The tool's own memory then
    stays at its peak until it exits. False where the C library is not glibc (nothing changes)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, -1))  # -1: never trim


def check_destination(load: Path, save: Path) -> None:
    """The output must neither touch the source nor overwrite anything."""
    source, destination = load.resolve(), save.resolve()
    if destination == source or source in destination.parents:
        raise InputError(f"--save {save} is inside --load {load}; the source checkpoint is never modified: "
                         "write the grown checkpoint to a new directory elsewhere")
    removed = remove_interrupted_writes(save, STAGING_PREFIX)
    if removed:
        print(f"--save {save}: removed {', '.join(removed)}, left by an earlier run of this tool that was stopped "
              "before it finished (incomplete)", file=sys.stderr)
    require_new_or_empty(save, "--save")


def _layout(config) -> str:
    return f"model_parallel_size {config.model_parallel_size}, pipe_parallel_size {config.pipe_parallel_size}"


def grow_checkpoint(load: Path, save: Path, configs: Sequence[str | Path], tag: str | None = None,
                    slot_overrides: dict[str, int | None] | None = None, *, zero_new_values: bool = False,
                    optimizer: str | None = None, reset_iteration: bool | None = None, allow_shrink: bool = False,
                    growth_mode: str | None = None, norm: str | None = None,
                    announce: Callable[[str], None] | None = None) -> tuple[Path, GrowthPlan]:
    """Write the grown (or re-sharded) checkpoint of `load` into `save`; its tag directory and the plan.
    `growth_mode`, `norm` ("old"/"new") and `optimizer` ("carry"/"reset"), where given, override the config's;
    `announce` is given the line saying that the default chose the growth mode, where it did, before growing."""
    load, save = Path(load), Path(save)
    check_destination(load, save)
    return write_grown_checkpoint(
        checkpoint_directory(load, tag), save, load_config(configs), keys_set(configs), slot_overrides,
        zero_new_values=zero_new_values, optimizer=optimizer, reset_iteration=reset_iteration,
        allow_shrink=allow_shrink, growth_mode=growth_mode, norm=norm, announce=announce)


def _summary(tag_dir: Path, plan: GrowthPlan, seconds: float, args: argparse.Namespace) -> str:
    size = sum(path.stat().st_size for path in tag_dir.rglob("*") if path.is_file())
    why = "growth mode official" if plan.resets_iteration and args.reset_iteration is None else None
    if plan.resets_optimizer:
        optimizer = "dropped"
    elif read_checkpoint(tag_dir).optimizer_step is None:
        optimizer = "none (the source holds none)"
    else:
        optimizer = "carried over" + (", new tokens' moments zero" if plan.grows else "")
    iteration = (f"restarts at 0 ({why or '--reset-iteration'})" if args.reset_iteration or why
                 else "continues")
    verb = {(True, False): "grew", (False, True): "shrank", (True, True): "resized"}.get(
        (plan.grows, plan.shrinks), "re-sharded")
    function = " (the function is kept)" if plan.keeps_function else " (the function changes)"
    lines = [f"{verb} {args.load} into {tag_dir} in {seconds:.1f} s",
             *(f"  {line}" for line in plan.summary()),
             f"  growth mode: {plan.describe()}" + (function if plan.grows else ""),
             f"  layout: {_layout(plan.source)} -> {_layout(plan.target)}",
             f"  optimizer state: {optimizer}; iteration and LR schedule: {iteration}",
             f"  wrote {size / 2**20:,.1f} MiB"]
    if args.zero_new_values and plan.grows:
        lines.append("  note: new tokens have zero keys and zero values, so they get no gradient (docs/growth.md)")
    return "\n".join(lines)


@one_line_errors("grow_checkpoint.py")
def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", type=Path, required=True, help="the source checkpoint directory (its `save`)")
    parser.add_argument("--tag", help="the checkpoint in --load to grow, e.g. global_step300 (default: `latest`)")
    parser.add_argument("--save", type=Path, required=True, help="a new directory for the grown checkpoint")
    parser.add_argument("--config", nargs="+", required=True, help="the target run's YAML files, merged left to right")
    for key in slot_keys():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"new {key} (default: the target config's)")
    parser.add_argument("--growth-mode", choices=GROWTH_MODES,
                        help="how new tokens are made (default: the target config's growth_mode, official unless "
                        "set): preserve keeps "
                        "the function; official copies the old rows into a fresh init as the official code does")
    parser.add_argument("--zero-new-values", action="store_true",
                        help="new value tokens zero instead of drawn from the init method (they then never learn)")
    parser.add_argument("--norm-token-count", choices=NORM_TOKEN_COUNTS,
                        help="the n of Θ's √n after growth (default: the config's growth_norm_token_count, else the "
                        "mode's: preserve old, official new); new changes the function")
    optimizer = parser.add_mutually_exclusive_group()
    optimizer.add_argument("--reset-optimizer", dest="optimizer", action="store_const", const="reset",
                           help="drop the Adam state (default with growth_mode official)")
    optimizer.add_argument("--carry-optimizer", dest="optimizer", action="store_const", const="carry",
                           help="grow the Adam state: the old tokens' moments and step kept, the new tokens' zero "
                           "(default with growth_mode preserve)")
    iteration = parser.add_mutually_exclusive_group()
    iteration.add_argument("--reset-iteration", action="store_const", const=True,
                           help="start at iteration 0 (LR schedule and data from the start) instead of continuing "
                           "(default with growth_mode official)")
    iteration.add_argument("--keep-iteration", dest="reset_iteration", action="store_const", const=False,
                           help="continue the iteration, LR schedule and data position (default with growth_mode "
                           "preserve)")
    parser.add_argument("--allow-shrink", action="store_true",
                        help="allow fewer tokens than the source: drops each Pattention's last tokens (lossy)")
    args = parser.parse_args(argv)
    keep_freed_memory_for_reuse()
    start = time.perf_counter()
    try:
        tag_dir, plan = grow_checkpoint(
            args.load, args.save, args.config, args.tag,
            {key: getattr(args, key) for key in slot_keys()},
            zero_new_values=args.zero_new_values, optimizer=args.optimizer, reset_iteration=args.reset_iteration,
            allow_shrink=args.allow_shrink, growth_mode=args.growth_mode, norm=args.norm_token_count,
            announce=lambda note: print(note, flush=True))
    except KeyboardInterrupt:
        parser.exit(130, f"{parser.prog}: interrupted; --save {args.save} holds nothing of this run\n")
    print(_summary(tag_dir, plan, time.perf_counter() - start, args))
    return tag_dir


if __name__ == "__main__":
    main()

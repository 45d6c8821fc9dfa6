"""Write a grown or re-sharded copy of one checkpoint: the code of tools/grow_checkpoint.py (docs/growth.md),
also run by deepy.py to resume a checkpoint on another layout (reshard_on_resume.py).

The source is only read; its files are checked against its manifest while growing (beside the growing, in
one process: nothing here is collective), and nothing is published unless they match. The output is written
under a temporary name and renamed when complete (checkpoint/commit.py).
"""

from __future__ import annotations

import shutil
from collections import deque
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from megatron.checkpoint.growth_record import read_growth_record
from megatron.checkpoint.manifest import content_digest
from megatron.checkpoint.save import checkpoint_tag
from megatron.config import Config
from megatron.formats.deepspeed.reader import SourceCheckpoint, read_checkpoint, verify_checkpoint
from megatron.formats.deepspeed.writer import CheckpointWriter
from megatron.growth.grow import grown_states
from megatron.growth.notes import default_mode_note
from megatron.growth.plan import GrowthPlan, pattention_entry, plan_growth

Item = TypeVar("Item")
_DONE = object()


def computed_ahead(items: Iterator[Item], ahead: int = 2) -> Iterator[Item]:
    """`items`, up to `ahead` of them computed in a background thread while the caller handles the one before:
    reading and growing the next entries overlap writing this one (torch and file I/O release the GIL), and
    a large entry's write does not leave the reading thread idle."""
    with ThreadPoolExecutor(1) as pool:
        pending = deque(pool.submit(next, items, _DONE) for _ in range(ahead))
        while (item := pending.popleft().result()) is not _DONE:
            pending.append(pool.submit(next, items, _DONE))
            yield item


def write_grown_checkpoint(tag_dir: Path, save: Path, target: Config, given: Collection[str] = (),
                           slot_overrides: dict[str, int | None] | None = None, *, zero_new_values: bool = False,
                           optimizer: str | None = None, reset_iteration: bool | None = None,
                           allow_shrink: bool = False, growth_mode: str | None = None, norm: str | None = None,
                           announce: Callable[[str], None] | None = None) -> tuple[Path, GrowthPlan]:
    """Write checkpoint `tag_dir` grown (or re-sharded) into the model and layout `target` describes into the
    new directory `save`; its tag directory and the plan. `given`: the keys the user set (for the note on the
    default growth mode). `growth_mode`, `norm` ("old"/"new") and `optimizer` ("carry"/"reset"), where given,
    override the config's; `reset_iteration` None restarts the iteration where the mode does (official growth), True
    or False always or never; `announce` is given the line saying that the default chose the growth mode, where
    it did, before growing. Whatever is raised, `save` is removed if this call created it."""
    created = not save.exists()
    with ThreadPoolExecutor(1) as pool:
        verification = pool.submit(verify_checkpoint, tag_dir)  # hashing the source beside the growing
        try:
            return _grow(read_checkpoint(tag_dir), save, target, given, slot_overrides, verification.result,
                         zero_new_values=zero_new_values, optimizer=optimizer, reset_iteration=reset_iteration,
                         allow_shrink=allow_shrink, growth_mode=growth_mode, norm=norm, announce=announce)
        except BaseException as error:  # KeyboardInterrupt too: nothing half-written stays behind
            if created:
                shutil.rmtree(save, ignore_errors=True)
            if isinstance(error, Exception):
                verification.result()  # a corrupt source is the cause of whatever reading it raised: name it
            raise


def _grow(source: SourceCheckpoint, save: Path, target: Config, given: Collection[str],
          slot_overrides: dict[str, int | None] | None, verified: Callable[[], None], *, zero_new_values: bool,
          optimizer: str | None, reset_iteration: bool | None, allow_shrink: bool, growth_mode: str | None,
          norm: str | None, announce: Callable[[str], None] | None) -> tuple[Path, GrowthPlan]:
    """write_grown_checkpoint's work, publishing only after `verified()` returned (it raises for a corrupt
    source)."""
    plan = plan_growth(source.config, target, slot_overrides, allow_shrink=allow_shrink,
                       zero_new_values=zero_new_values, mode=growth_mode, norm=norm, optimizer=optimizer)
    note = default_mode_note(plan, set(given) | ({"growth_mode"} if growth_mode else set()))
    if note and announce:
        announce(note)
    reset_optimizer = plan.resets_optimizer
    reset_iteration = plan.resets_iteration if reset_iteration is None else reset_iteration
    iteration = 0 if reset_iteration else source.iteration
    record = plan.growth_record(read_growth_record(source.tag_dir))
    writer = CheckpointWriter(
        save, checkpoint_tag(iteration), plan.target, iteration=iteration,
        consumed_train_samples=0 if reset_iteration else source.consumed_train_samples,
        optimizer_step=None if reset_optimizer else source.optimizer_step,
        growth_record=None if record is None else {**record, "source_sha256": content_digest(source.tag_dir)})
    norms: dict[str, int] = {}  # the n of √n the output holds per kind, for the growth record
    with writer:
        for name, state in computed_ahead(grown_states(source.names(), source.state, plan)):
            entry = pattention_entry(name)
            if entry is not None and entry[1] == "norm_token_count":
                norms.setdefault(entry[0], int(state.weight))
            writer.write(name, state.without_moments() if reset_optimizer else state)
        verified()
        if writer.growth_record is not None and (plan.grows or iteration != source.iteration):
            # where a ramp starts: this growth, or this restart of the iteration (the n the output holds)
            writer.growth_record = {**writer.growth_record, "norm_token_count": norms, "iteration": iteration}
        return writer.commit(), plan

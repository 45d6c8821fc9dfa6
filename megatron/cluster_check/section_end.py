"""Every rank's outcome of a section (None, or what it raised), exchanged through the run's TCPStore.

Not through the process group: a rank whose section raised must enter no collective, since the others may be
waiting in one of the section's (an all-reduce in throughput) and the two would be paired. Each rank sets its
outcome in the store, counts itself in, and waits for the last to arrive with the hang watch armed
(megatron/runtime/hang_watch.py): when a rank does not come back within hang_timeout, the watch ends the check
with the section's FAIL naming it. Without a watch (hang_timeout 0, or no env:// store) the outcomes are
gathered by a collective, as before the watch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from megatron.cluster_check.ranks import gather
from megatron.runtime.hang_watch import PREFIX, HangWatch, store_client

RETRY_SECONDS = 0.05
T = TypeVar("T")


def _answer(call: Callable[[], T]) -> T:
    """The store's answer to `call`, asked again while it gives none (its host stopped or dead: the hang watch
    ends the check meanwhile)."""
    while True:
        try:
            return call()
        except Exception:  # noqa: BLE001 (the store's timeout; the watch judges)
            time.sleep(RETRY_SECONDS)


def section_outcomes(watch: HangWatch | None, index: int, error: str | None) -> list[str | None]:
    """Every rank's outcome of section number `index` (the same on every rank), in rank order."""
    if watch is None or watch.store is None:
        return gather(error)
    store = _answer(lambda: store_client(watch.beat_seconds))
    rank, world, key = dist.get_rank(), dist.get_world_size(), f"{PREFIX}section{index}/"
    if error is not None:
        _answer(lambda: store.set(f"{key}{rank}", error))
        _answer(lambda: store.add(f"{key}raised", 1))
    watch.error = error  # in its beats: the watch's verdict names it
    watch.step_done(index + 1)  # arrived: the wait for the others is timed
    if _answer(lambda: store.add(f"{key}arrived", 1)) >= world:  # the last to arrive lets every rank go
        _answer(lambda: store.set(f"{key}all", "1"))
    _answer(lambda: store.wait([f"{key}all"], timedelta(seconds=watch.beat_seconds)))
    watch.armed, watch.error = False, None
    if not _answer(lambda: store.add(f"{key}raised", 0)):  # the usual case: one read, not one a rank
        return [None] * world
    return [_answer(lambda: store.get(f"{key}{other}").decode()) if store.check([f"{key}{other}"]) else None
            for other in range(world)]

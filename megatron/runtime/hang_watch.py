"""End a job whose steps stopped: name the ranks that did not arrive, write every rank's stack, exit HUNG.

A rank stuck in a collective (a stopped or dead peer, a bad link, a deadlock) waits in it for the process group's
timeout, torch's 30 minutes, which the start needs: ranks of a large job arrive unevenly. So the group keeps it,
and each rank runs this watch instead: a thread that sees the loop's progress counter (bumped on the host once a
step, no device sync) and ends the job when it has not moved for `hang_timeout` seconds while steps run. It is
armed after the first step (compilation) and paused around evaluation and checkpoint saves. A collective timeout
set on the group after the start would also fire inside saves and evaluation, and would name no rank.

The thread beats through the TCPStore the ranks rendezvoused at (its own client, with a short timeout, so a
stopped store host cannot hold it): its rank's iteration and host. The rank that finds the hang first claims it,
waits two beats, and names the ranks whose beat stopped (stopped or dead) or whose iteration is behind (stuck
on their own), and where it waited itself. Every rank that can writes its Python stack (faulthandler) and, on
NCCL, the Flight Recorder's record of its collectives to log_dir/hangs; then exits HUNG.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.config.run_inputs import HUNG

PREFIX = "tokenformer/hang_watch/"
CLAIM = PREFIX + "hung"
# Collectives the NCCL Flight Recorder keeps per rank; read at the group's creation, so set before it.
FLIGHT_RECORDER_ENTRIES = "2000"


def record_collectives(backend: str, hang_timeout: float) -> None:
    """On NCCL with the watch on: keep the Flight Recorder's record (the user's settings win)."""
    if backend == "nccl" and hang_timeout > 0:
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)


def _flight_recorder_dump() -> bytes | None:
    """The NCCL Flight Recorder's record of this rank's collectives (pickled), where torch was built with NCCL."""
    if dist.get_backend() != "nccl":
        return None
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
    return dump() if dump is not None else None


def _where(thread_id: int) -> str:
    """'FUNCTION (FILE:LINE), called from FUNCTION (FILE:LINE)': the innermost frame of the thread and the
    innermost of this project's."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "an unknown place"
    innermost, ours = frame, None
    while frame is not None:
        if ours is None and "/megatron/" in frame.f_code.co_filename:
            ours = frame
        frame = frame.f_back
    text = f"{innermost.f_code.co_name} ({innermost.f_code.co_filename}:{innermost.f_lineno})"
    if ours is not None and ours is not innermost:
        text += f", called from {ours.f_code.co_name} ({ours.f_code.co_filename}:{ours.f_lineno})"
    return text


class HangWatch:
    """One rank's watch (module docstring). `step_done` after each step; `paused()` around evaluation and saves;
    `stop()` when the steps are over."""

    def __init__(self, hang_timeout: float, log_dir: Path) -> None:
        self.timeout, self.folder = hang_timeout, log_dir / "hangs"
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.host = socket.gethostname()
        self.beat_seconds = min(10.0, max(0.5, hang_timeout / 5))
        self.iteration, self.armed, self.last_progress = 0, False, time.monotonic()
        self._main = threading.main_thread().ident
        self._stopped = threading.Event()
        self._store = None  # a group started without env:// variables (a file:// store): no beats, no names
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                        wait_for_workers=False, timeout=timedelta(seconds=self.beat_seconds))
        self._beats = 0
        self._thread = threading.Thread(target=self._watch, name="hang_watch", daemon=True)
        self._thread.start()

    def step_done(self, iteration: int) -> None:
        self.iteration, self.last_progress, self.armed = iteration, time.monotonic(), True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        armed, self.armed = self.armed, False
        try:
            yield
        finally:
            self.last_progress, self.armed = time.monotonic(), armed

    def stop(self) -> None:
        self.armed = False
        self._stopped.set()

    def _beat(self) -> None:
        self._beats += 1
        record = {"beat": self._beats, "iteration": self.iteration, "host": self.host}
        with contextlib.suppress(Exception):  # a store host stopped: the watch still sees its own rank
            self._store.set(f"{PREFIX}{self.rank}", json.dumps(record))

    def _told(self) -> bool:
        try:
            return self._store.check([CLAIM])
        except Exception:  # noqa: BLE001 (an unreachable store tells nothing)
            return False

    def _watch(self) -> None:
        self._beat()  # at once: a rank stopped before its first beat still has a host to be named by
        woke = time.monotonic()
        while not self._stopped.wait(self.beat_seconds):
            slept, woke = time.monotonic() - woke, time.monotonic()
            self._beat()
            stalled = self.armed and woke - self.last_progress > self.timeout
            # A rank that was itself stopped (SIGSTOP, then the launcher's SIGCONT) is the hang, not its judge.
            was_stopped = slept > 3 * self.beat_seconds + 1
            if stalled or self._told():
                self._end(found_here=stalled and not was_stopped)

    def _beats_now(self) -> dict[int, dict | None]:
        beats = {}
        for rank in range(self.world):
            try:
                beats[rank] = json.loads(self._store.get(f"{PREFIX}{rank}"))
            except Exception:  # noqa: BLE001 (no beat, or the store does not answer)
                beats[rank] = None
        return beats

    def _verdict(self) -> str:
        """The line naming the ranks that did not arrive and where this rank waited."""
        before = self._beats_now()
        for _ in range(2):  # this rank beats on: it is alive
            time.sleep(self.beat_seconds)
            self._beat()
        after = self._beats_now()
        alive = {r: b for r, b in after.items() if b and before[r] and b["beat"] != before[r]["beat"]}
        furthest = max((b["iteration"] for b in alive.values()), default=self.iteration)
        missing = []
        for rank in range(self.world):
            beat = after[rank] or before[rank]
            host = beat["host"] if beat else "an unknown host"
            if rank not in alive:
                missing.append(f"rank {rank} on {host} (its heartbeat stopped: the process is stopped or dead)")
            elif alive[rank]["iteration"] < furthest:
                missing.append(f"rank {rank} on {host} (alive, but still in iteration {alive[rank]['iteration'] + 1})")
        names = "; ".join(missing) or "none found (every rank beats at the same iteration: a deadlock among them)"
        return (f"hang: no step finished for {self.timeout:g} s (hang_timeout) after iteration {self.iteration}. "
                f"Did not arrive: {names}. Rank {self.rank} on {self.host} waited in {_where(self._main)}. "
                f"Every rank's stack: {self.folder.resolve()}")

    def _end(self, found_here: bool) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rank{self.rank}.stacks.txt", "w") as stacks:
            stacks.write(f"rank {self.rank} on {self.host}, after iteration {self.iteration}\n")
            stacks.flush()
            faulthandler.dump_traceback(stacks, all_threads=True)
        with contextlib.suppress(Exception):
            record = _flight_recorder_dump()
            if record:
                (self.folder / f"rank{self.rank}.flight_recorder.pickle").write_bytes(record)
        claimed = False
        if found_here:
            try:
                claimed = self._store.add(CLAIM, 1) == 1
            except Exception:  # noqa: BLE001 (the store's host is the stopped rank: each rank says what it sees)
                claimed = True
        if claimed:
            print(self._verdict(), file=sys.stderr, flush=True)
        else:  # the claiming rank names the ranks (two beats) before this one's end ends the job
            time.sleep(4 * self.beat_seconds)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HUNG)


def start_hang_watch(hang_timeout: float, log_dir: str | None) -> HangWatch | None:
    """The watch for this rank, or None when hang_timeout is 0."""
    if not hang_timeout:
        return None
    return HangWatch(hang_timeout, Path(log_dir or "."))

"""End a job whose steps stopped: name the ranks that did not arrive, write every rank's stack, exit HUNG.

A rank stuck in a collective (a stopped or dead peer, a bad link, a deadlock) waits in it for the process group's
timeout, torch's 30 minutes, which the start needs: ranks of a large job arrive unevenly. So the group keeps it,
and each rank runs this watch instead: a thread that sees the loop's progress counter (bumped on the host once a
step, no device sync) and ends the job when it has not moved for `hang_timeout` seconds while steps run. It is
armed after the first step (compilation) and paused around evaluation and checkpoint saves, never around a
collective every step takes. A collective timeout set on the group after the start would also fire inside saves
and evaluation, and would name no rank.

The thread beats through the TCPStore the ranks rendezvoused at (its own client, with a short timeout, so a
stopped store host cannot hold it): its rank's iteration and host. It also reads the next rank's beat: a peer
whose beat stopped for `hang_timeout` is a hang whatever this rank is doing (paused, or before its first step).
One read a beat per rank keeps the store's load linear in the ranks. The rank that finds the hang first claims it,
waits two beats, and names the ranks whose beat stopped (stopped or dead) or whose iteration is behind (stuck
on their own), and where it waited itself. Every rank that can writes its Python stack (faulthandler) and, on
NCCL, the Flight Recorder's record of its collectives to log_dir/hangs; then exits HUNG. A backstop for the
watch itself: faulthandler's own thread (no GIL, no store) writes the stacks to stderr and ends the process if
the watch thread has not beaten for `hang_timeout` + BACKSTOP_SECONDS.

The cluster check (megatron/cluster_check/check.py) uses the same watch with its sections as the positions
and `at_hang` writing the report.
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
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.config.run_inputs import HUNG

PREFIX = "tokenformer/hang_watch/"
CLAIM = PREFIX + "hung"
# Collectives the NCCL Flight Recorder keeps per rank; read at the group's creation, so set before it.
FLIGHT_RECORDER_ENTRIES = "2000"
BACKSTOP_SECONDS = 60


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


def store_client(timeout: float) -> dist.TCPStore | None:
    """A client of the TCPStore the ranks rendezvoused at whose calls give up after `timeout` seconds (a stopped
    store host cannot hold its caller), or None for a group started without env:// variables (a file:// store)."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         wait_for_workers=False, timeout=timedelta(seconds=timeout))


class HangWatch:
    """One rank's watch (module docstring). `step_done` after each step; `paused()` around evaluation and saves;
    `stop()` when the steps are over. `position_text(n)` says where a rank at position n is still (by default
    'iteration n+1'); `at_hang(line, absent)`, on the rank that claimed the hang, reports it (by default: the line
    to stderr) before the process exits `exit_status`; `absent` maps each rank that did not arrive to why."""

    def __init__(self, hang_timeout: float, log_dir: Path, *, exit_status: int = HUNG,
                 at_hang: Callable[[str, dict[int, str]], None] | None = None,
                 position_text: Callable[[int], str] = lambda position: f"iteration {position + 1}") -> None:
        self.timeout, self.folder = hang_timeout, log_dir / "hangs"
        self.exit_status, self.at_hang, self.position_text = exit_status, at_hang, position_text
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.host = socket.gethostname()
        self.beat_seconds = min(10.0, max(0.5, hang_timeout / 5))
        self.iteration, self.armed, self.last_progress = 0, False, time.monotonic()
        self.error: str | None = None  # what this rank raised, in its beats (the cluster check's sections)
        self._main = threading.main_thread().ident
        self._stopped = threading.Event()
        self.store = store_client(self.beat_seconds)  # None: no beats, no names
        self._beats = 0
        self._peer, self._peer_beat, self._peer_seen = (self.rank + 1) % self.world, None, time.monotonic()
        # Before this rank goes on: a rank stopped right after would otherwise have no beat for its peer to see stop.
        self._beat()
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
        faulthandler.cancel_dump_traceback_later()

    def _beat(self) -> None:
        self._beats += 1
        record = {"beat": self._beats, "iteration": self.iteration, "host": self.host, "error": self.error}
        with contextlib.suppress(Exception):  # a store host stopped: the watch still sees its own rank
            self.store.set(f"{PREFIX}{self.rank}", json.dumps(record))

    def told(self) -> bool:
        """Whether a rank claimed a hang (the job is ending)."""
        try:
            return self.store.check([CLAIM])
        except Exception:  # noqa: BLE001 (an unreachable store tells nothing)
            return False

    def _peer_stopped(self, now: float) -> bool:
        """Whether the next rank's beat, once seen, has not moved for hang_timeout (its process stopped or
        died); an unreachable store counts as no move."""
        if self.world == 1 or self.store is None:
            return False
        with contextlib.suppress(Exception):
            beat = json.loads(self.store.get(f"{PREFIX}{self._peer}"))["beat"]
            if beat != self._peer_beat:
                self._peer_beat, self._peer_seen = beat, now
        return self._peer_beat is not None and now - self._peer_seen > self.timeout

    def _watch(self) -> None:
        woke = time.monotonic()
        while not self._stopped.wait(self.beat_seconds):
            faulthandler.dump_traceback_later(self.timeout + BACKSTOP_SECONDS, exit=True)
            slept, woke = time.monotonic() - woke, time.monotonic()
            self._beat()
            # A rank that was itself stopped (SIGSTOP, then the launcher's SIGCONT) is the hang, not its judge.
            if slept > 3 * self.beat_seconds + 1:
                self.last_progress = self._peer_seen = woke
                continue
            stalled = (self.armed and woke - self.last_progress > self.timeout) or self._peer_stopped(woke)
            if stalled or self.told():
                self._end(found_here=stalled)

    def _beats_now(self) -> dict[int, dict | None]:
        beats = {}
        for rank in range(self.world):
            try:
                beats[rank] = json.loads(self.store.get(f"{PREFIX}{rank}"))
            except Exception:  # noqa: BLE001 (no beat, or the store does not answer)
                beats[rank] = None
        return beats

    def _verdict(self) -> tuple[str, dict[int, str]]:
        """The line naming the ranks that did not arrive and where this rank waited; each such rank and why."""
        before = self._beats_now()
        for _ in range(2):  # this rank beats on: it is alive
            time.sleep(self.beat_seconds)
            self._beat()
        after = self._beats_now()
        alive = {r: b for r, b in after.items() if b and before[r] and b["beat"] != before[r]["beat"]}
        alive[self.rank] = {"iteration": self.iteration, "host": self.host, "error": self.error}
        furthest, slowest = (f(b["iteration"] for b in alive.values()) for f in (max, min))
        absent, named = {}, []
        for rank in range(self.world):
            beat = after[rank] or before[rank]
            if rank not in alive:
                absent[rank] = "its heartbeat stopped: the process is stopped or dead"
            elif alive[rank].get("error"):
                absent[rank] = f"raised {alive[rank]['error']}"
            elif alive[rank]["iteration"] < furthest:
                absent[rank] = f"alive, but still in {self.position_text(alive[rank]['iteration'])}"
            if rank in absent:
                named.append(f"rank {rank} on {beat['host'] if beat else 'an unknown host'} ({absent[rank]})")
        names = "; ".join(named) or "none found (every rank beats at the same iteration: a deadlock among them)"
        return (f"hang: no progress for {self.timeout:g} s (hang_timeout) in {self.position_text(slowest)}. "
                f"Did not arrive: {names}. Rank {self.rank} on {self.host} waited in {_where(self._main)}. "
                f"Every rank's stack: {self.folder.resolve()}", absent)

    def _end(self, found_here: bool) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rank{self.rank}.stacks.txt", "w") as stacks:
            stacks.write(f"rank {self.rank} on {self.host}, in {self.position_text(self.iteration)}\n")
            stacks.flush()
            faulthandler.dump_traceback(stacks, all_threads=True)
        with contextlib.suppress(Exception):
            record = _flight_recorder_dump()
            if record:
                (self.folder / f"rank{self.rank}.flight_recorder.pickle").write_bytes(record)
        claimed = False
        if found_here:
            try:
                claimed = self.store.add(CLAIM, 1) == 1
            except Exception:  # noqa: BLE001 (the store's host is the stopped rank: each rank says what it sees)
                claimed = True
        if claimed:
            line, absent = self._verdict()
            print(line, file=sys.stderr, flush=True)
            if self.at_hang is not None:
                self.at_hang(line, absent)
        else:  # the claiming rank names the ranks (two beats) before this one's end ends the job
            time.sleep(4 * self.beat_seconds)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.exit_status)


def start_hang_watch(hang_timeout: float, log_dir: str | None, **reporting) -> HangWatch | None:
    """The watch for this rank (`reporting`: HangWatch's keywords), or None when hang_timeout is 0."""
    if not hang_timeout:
        return None
    return HangWatch(hang_timeout, Path(log_dir or "."), **reporting)

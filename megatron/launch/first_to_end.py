"""Which rank the launcher saw end first, and how: the cause of a failed job, where the other ranks' errors (a gloo
"connection reset") follow from it.

The launcher logs it when it ends the others. DeepSpeed's per-node launcher (a pdsh run, each line prefixed with
its host), in one line:
    [ERROR] [launch.py:N:sigkill_handler] ['python', '-u', 'train.py', '--local_rank=1', ...] exits with
    return code = -9
and local_ranks.py on one machine its FIRST_TO_END_LINE. srun names no first task: it reports each task that ended
badly as it notices it (`srun: error: HOST: task 1: Killed`), which is kept as srun says it.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from typing import BinaryIO, TextIO

from megatron.config.run_inputs import HUNG

FIRST_TO_END = re.compile(r"(?:^|\n)(?:(?:(?P<host>[\w.-]+): )?[^\n]*sigkill_handler\][^\n]*--local_rank=(?P<rank>\d+)"
                          r"|local_ranks: local rank (?P<local>\d+) ended first with)"
                          r"[^\n]*return code = (?P<code>-?\d+)")
SRUN_TASK_END = re.compile(r"srun: error: (?P<host>[\w.-]+): (?P<tasks>tasks? [\d,-]+): (?P<how>.+)")
# How much of the launcher's latest output is searched, for a line split across reads.
TAIL_CHARACTERS = 16384


class FirstRankToEnd:
    """Passes the launcher's output (the ranks' too) on unchanged, and notes the first rank to end in it."""

    def __init__(self, stdout: BinaryIO, stderr: BinaryIO) -> None:
        self.local_rank: int | None = None
        self.code: int | None = None  # its exit code (-N: killed by signal N)
        self.host: str | None = None  # None: this machine, under local_ranks.py
        self.srun_task_ends: list[str] = []  # 'task 1 on node-a: Killed', as srun reports them
        self._threads = []
        for stream, target in ((stdout, sys.stdout), (stderr, sys.stderr)):
            thread = threading.Thread(target=self._forward, args=(stream, target), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _forward(self, stream: BinaryIO, target: TextIO) -> None:
        tail = line = ""
        chunk = os.read(stream.fileno(), 65536)
        while chunk:
            try:
                if hasattr(target, "buffer"):
                    target.buffer.write(chunk)
                else:  # a text stream without bytes underneath (a test's capture)
                    target.write(chunk.decode("utf-8", "replace"))
                target.flush()
            except (OSError, ValueError):
                pass  # deepy.py's own output is gone: keep draining, or the ranks would block writing theirs
            text = chunk.decode("utf-8", "replace")
            if self.code is None:
                tail = (tail + text)[-TAIL_CHARACTERS:]
                self._note(FIRST_TO_END.search(tail))
            *lines, line = (line + text).split("\n")
            line = line[-TAIL_CHARACTERS:]
            self.srun_task_ends += [f"{end['tasks']} on {end['host']}: {end['how']}"
                                    for end in map(SRUN_TASK_END.fullmatch, lines) if end]
            chunk = os.read(stream.fileno(), 65536)

    def _note(self, match: re.Match | None) -> None:
        if match:
            self.local_rank = int(match["rank"] or match["local"])
            self.host = match["host"]
            self.code = int(match["code"])

    def wait(self) -> None:
        """Until the launcher's output has ended (or 10 s per stream)."""
        for thread in self._threads:
            thread.join(timeout=10)


def describe_end(local_rank: int, code: int, host: str | None = None, why_killed: str | None = None) -> str:
    """'local rank 1 on host-a was the first to end: killed by SIGKILL[, WHY_KILLED]'."""
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    if code == HUNG:
        how += " (a hang: the 'hang:' line names the ranks that did not arrive)"
    if why_killed:
        how = f"{how}, {why_killed}"
    where = f" on {host}" if host else ""
    return f"local rank {local_rank}{where} was the first to end: {how}"

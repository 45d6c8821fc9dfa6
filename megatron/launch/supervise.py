"""deepy.py's part once the ranks run: pass a stop signal on to them, wait, and end on a line a person reads.

SIGTERM (a scheduler's stop, `kill`) or SIGINT (Ctrl-C) to deepy.py would end deepy.py alone, leaving the
ranks to train on unattached. So the launcher (local_ranks.py on one machine; DeepSpeed's runner, srun or
mpirun across hosts) runs in a session of its own, and a signal to deepy.py is sent on as SIGTERM to every rank
on this machine, which saves a checkpoint at the next iteration boundary and exits 0 (training/preemption.py);
deepy.py then waits for the launcher to finish and exits with it. Ranks on other hosts get it from the launcher
(SIGTERM to srun or mpirun is forwarded to their tasks). A launcher killed on its own (SIGKILL, or SIGTERM to
DeepSpeed's runner, which ends it alone) leaves its ranks to deepy.py, the subreaper of its descendants, which
passes the stop on to them and exits with them. A SIGKILL to deepy.py itself is seen by the ranks here
(megatron/host/orphan_watch.py). When the job fails, the rank the launcher saw end first, and how, is named as
the cause (unless that is the cluster check's verdict that sections failed); when it fails because the stop
reached ranks still starting (before they catch it), deepy.py says it stopped as asked and exits 128+N (130 for
Ctrl-C), as it does for a stopped cluster check, whose ranks end at once and leave its report INCOMPLETE.
Whatever outlives the ranks (a compiler DeepSpeed started on a first start) is ended as soon as they are.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from megatron.config.run_inputs import CLUSTER_CHECK_FAILED, CLUSTER_CHECK_SCRIPT
from megatron.host.orphan_watch import VARIABLE as ORPHAN_VARIABLE
from megatron.host.orphan_watch import launcher_identity

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How long a runner whose ranks ended may take to exit before what is left is ended.
RUNNERS_GRACE_SECONDS = 5
# The launcher, when a rank ends badly, ends the others and logs the first one it saw end. DeepSpeed's per-node
# launcher (a pdsh run, each line prefixed with its host):
#   [ERROR] [launch.py:N:sigkill_handler] ['python', '-u', 'train.py', '--local_rank=1', ...] exits with
#   return code = -9   (one line)
# On one machine, local_ranks.py logs it (FIRST_TO_END_LINE).
FIRST_TO_END = re.compile(r"(?:^|\n)(?:(?:(?P<host>[\w.-]+): )?[^\n]*sigkill_handler\][^\n]*--local_rank=(?P<rank>\d+)"
                          r"|local_ranks: local rank (?P<local>\d+) ended first with)"
                          r"[^\n]*return code = (?P<code>-?\d+)")


class FirstRankToEnd:
    """Passes the launcher's output (the ranks' too) on unchanged and remembers which rank the launcher saw end
    first, and how (it logs that to stdout): the cause, where the other ranks' errors (a gloo
    "connection reset") follow from it."""

    def __init__(self, stdout, stderr) -> None:
        self.found: str | None = None
        self.code: int | None = None  # its exit code (-N: killed by signal N)
        self._threads = [threading.Thread(target=self._forward, args=(stream, target), daemon=True)
                         for stream, target in ((stdout, sys.stdout), (stderr, sys.stderr))]
        for thread in self._threads:
            thread.start()

    def _forward(self, stream, target) -> None:
        tail = ""
        while chunk := os.read(stream.fileno(), 65536):
            try:
                if hasattr(target, "buffer"):
                    target.buffer.write(chunk)
                else:  # a text stream without bytes underneath (a test's capture)
                    target.write(chunk.decode("utf-8", "replace"))
                target.flush()
            except (OSError, ValueError):
                pass  # deepy.py's own output is gone: keep draining, or the ranks would block writing theirs
            if self.found is None:
                tail = (tail + chunk.decode("utf-8", "replace"))[-16384:]
                match = FIRST_TO_END.search(tail)
                if match:
                    self.code = int(match["code"])
                    self.found = describe_end(int(match["rank"] or match["local"]), self.code, match["host"])

    def wait(self) -> str | None:
        for thread in self._threads:
            thread.join(timeout=10)
        return self.found


def describe_end(local_rank: int, code: int, host: str | None = None) -> str:
    """'local rank 1 (on host-a) was the first to end: killed by SIGKILL'."""
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    return f"local rank {local_rank}{f' on {host}' if host else ''} was the first to end: {how}"


def runs_script(command_line: list[str], script: str) -> bool:
    """Whether `command_line` (python [options] SCRIPT args) runs `script`; the launchers between deepy.py and
    the ranks run modules (`python -m megatron.launch.local_ranks ... train.py ...`) and do not."""
    for argument in command_line[1:]:
        if argument == "-m":
            return False
        if not argument.startswith("-"):
            return Path(argument).name == Path(script).name
    return False


def _local_ranks(launcher: psutil.Process, script: str) -> list[psutil.Process]:
    """The processes under `launcher` that run `script`: the ranks on this machine."""
    ranks = []
    for process in launcher.children(recursive=True):
        try:
            if runs_script(process.cmdline(), script):
                ranks.append(process)
        except psutil.Error:
            continue  # ended meanwhile
    return ranks


def _become_subreaper() -> None:
    """Make ranks orphaned by a killed launcher (not deepy.py) deepy.py's children, so that the stop still
    reaches them and deepy.py waits for them. Linux only; elsewhere nothing."""
    pr_set_child_subreaper = 36  # <linux/prctl.h>
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _is_a_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _end_leftovers(this_process: psutil.Process) -> None:
    """End what outlived the ranks: a compiler a rank started (DeepSpeed builds its op on first start) goes on
    as an orphan, deepy.py's as the subreaper, when the rank is stopped mid-build."""
    leftovers = this_process.children(recursive=True)
    for process in leftovers:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(leftovers, timeout=10)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass


def _stop(ranks: list[psutil.Process], reason: str, script: str) -> None:
    then = ("stop the check and mark its report INCOMPLETE" if Path(script).name == CLUSTER_CHECK_SCRIPT else
            "save a checkpoint and stop")
    print(f"deepy.py: {reason}; SIGTERM sent to the {len(ranks)} ranks here, which {then}", file=sys.stderr,
          flush=True)
    for process in ranks:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass  # ended meanwhile


def run_launcher(command: list[str], script: str) -> int:
    """Run the launcher `command` of `script`'s ranks to its end; the exit code: the launcher's (128+N for a
    signal N), or, if the launcher was killed and its ranks here stopped on their own, theirs, or 128+N for a
    stop signal N that ended ranks still starting.

    From this call on the stop signals are this function's, for the rest of the process: one that arrives while
    the launcher is being started is passed on as soon as it has started (deepy.py must not exit and leave what
    it started to the ranks' orphan watch), and one that arrives after the launcher ended has nothing to stop
    and says so."""
    _become_subreaper()
    this_process = psutil.Process()
    requested: list[int] = []
    launcher: subprocess.Popen | None = None
    ended = False  # the ranks and what they started

    def pass_on(number: int) -> None:
        ranks = _local_ranks(this_process, script)
        if ranks:
            _stop(ranks, f"{signal.Signals(number).name} received", script)
        else:  # ranks on other hosts, or none yet: the launcher (srun, mpirun) forwards it to them
            launcher.send_signal(signal.SIGTERM)

    def stop(number: int, frame: object) -> None:
        if ended:
            print(f"deepy.py: {signal.Signals(number).name} received after the ranks ended; nothing left to stop",
                  file=sys.stderr, flush=True)
            return
        requested.append(number)
        if launcher is not None:
            pass_on(number)

    for number in STOP_SIGNALS:
        signal.signal(number, stop)
    # The ranks' output reaches deepy.py's through pipes (FirstRankToEnd): they are told whether a person reads it.
    environment = {ORPHAN_VARIABLE: launcher_identity(), "TOKENFORMER_STDERR_IS_A_TERMINAL": str(int(_is_a_terminal()))}
    launcher = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=dict(os.environ, **environment))
    if requested:  # a stop while it was being started
        pass_on(requested[0])
    first_to_end = FirstRankToEnd(launcher.stdout, launcher.stderr)
    code = launcher.wait()
    orphans = _local_ranks(this_process, script) if code < 0 else []
    if orphans:
        _stop(orphans, f"the launcher was ended by {signal.Signals(-code).name}", script)
        gone, _ = psutil.wait_procs(orphans)
        code = next((p.returncode for p in gone if p.returncode), 0)
    # Ranks left behind by a killed launcher end on their own, and their runners with them; what outlives them
    # (a compiler a rank started, now deepy.py's child) is ended at once.
    psutil.wait_procs(_local_ranks(this_process, script), timeout=60)
    psutil.wait_procs(this_process.children(), timeout=RUNNERS_GRACE_SECONDS)
    _end_leftovers(this_process)
    ended = True
    code = code if code >= 0 else 128 - code
    first = first_to_end.wait()
    if code and requested and Path(script).name == CLUSTER_CHECK_SCRIPT:
        name = signal.Signals(requested[0]).name
        print(f"deepy.py: {script} stopped at your request ({name}); a report it began (cluster_check.md in "
              "log_dir) is marked INCOMPLETE", file=sys.stderr, flush=True)
        return 128 + requested[0]
    if code and requested and first_to_end.code in (None, -signal.SIGTERM):
        # The stop reached ranks still starting (importing, compiling), before they could catch it and save.
        name = signal.Signals(requested[0]).name
        print(f"deepy.py: {script} stopped at your request ({name}) while its ranks were starting, before they "
              "could save a checkpoint", file=sys.stderr, flush=True)
        return 128 + requested[0]
    if code and first_to_end.code == CLUSTER_CHECK_FAILED and Path(script).name == CLUSTER_CHECK_SCRIPT:
        print(f"deepy.py: {script} found failures (exit status {code}): the summary above names them",
              file=sys.stderr, flush=True)
    elif code:
        cause = f"{first}; the errors of the other ranks follow from it" if first else (
            "the first error printed above is the cause")
        print(f"deepy.py: {script} failed (the launcher exited {code}); {cause}", file=sys.stderr, flush=True)
    return code

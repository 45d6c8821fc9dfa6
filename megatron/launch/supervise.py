"""deepy.py's part once the ranks run: pass a stop on to them, wait, and end on a line a person reads.

A stop signal to deepy.py (JOB_STOP_SIGNALS: a scheduler's SIGTERM or SIGUSR1, Ctrl-C, a closed terminal) must
reach the ranks, which save a checkpoint and exit 0 (training/preemption.py), instead of ending deepy.py alone.
So the launcher (local_ranks.py here; DeepSpeed's runner, srun or mpirun across hosts) runs in a session of its
own; deepy.py sends SIGTERM to each rank on this machine (the launcher forwards it to the others) and exits as the
launcher does. As the subreaper of its descendants, it stops the ranks of a killed launcher too. A failed job
ends on the rank that ended first, and how (first_to_end.py; a SIGKILL by the out-of-memory killer named as
such, out_of_memory.py), or, when the stop reached ranks still starting, on "stopped at your request", 128+N;
a stopped cluster check, whose ranks end at once, leaves its report INCOMPLETE and says so, 128+N.
run_launcher runs one launch; launch/restarts.py launches again after a failure, up to max_restarts times.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from megatron.cli import JOB_STOP_SIGNALS
from megatron.config.run_inputs import CLUSTER_CHECK_FAILED, CLUSTER_CHECK_SCRIPT, HUNG
from megatron.host.orphan_watch import VARIABLE as ORPHAN_VARIABLE
from megatron.host.orphan_watch import launcher_identity
from megatron.launch.first_to_end import FirstRankToEnd, describe_end
from megatron.launch.hosts import is_local_host
from megatron.launch.out_of_memory import oom_kill_counts, out_of_memory_kills

# How long a runner whose ranks ended may take to exit before what is left is ended.
RUNNERS_GRACE_SECONDS = 5


@dataclass(frozen=True)
class LaunchEnd:
    """How one launch ended: deepy.py's exit status for it, and for a failure which rank ended first and how, where
    the launcher's output tells (first_to_end.py), for a restart to say."""

    code: int
    first_to_end: str | None = None


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


def say(line: str) -> None:
    """Print `line` on stderr, unless that is gone (a hung-up terminal): nothing must keep a stop from the ranks."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _stop(ranks: list[psutil.Process], reason: str, script: str) -> None:
    for process in ranks:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass  # ended meanwhile
    then = ("stop the check and mark its report INCOMPLETE" if Path(script).name == CLUSTER_CHECK_SCRIPT else
            "save a checkpoint and stop")
    say(f"deepy.py: {reason}; SIGTERM sent to the {len(ranks)} ranks here, which {then}")


def _why_killed(first_to_end: FirstRankToEnd, kills_before: dict[str, int]) -> str | None:
    """Why a rank of this machine was killed by SIGKILL, where the kernel's counts tell."""
    if first_to_end.code != -signal.SIGKILL or not (first_to_end.host is None or is_local_host(first_to_end.host)):
        return None
    return out_of_memory_kills(kills_before, oom_kill_counts())


def _first_to_end(first_to_end: FirstRankToEnd, kills_before: dict[str, int]) -> str | None:
    """'local rank 1 was the first to end: killed by SIGKILL', where the launcher's output tells."""
    if first_to_end.code is None:
        return None
    return describe_end(first_to_end.local_rank, first_to_end.code, first_to_end.host,
                        _why_killed(first_to_end, kills_before))


def _ended_badly(first_to_end: FirstRankToEnd, first: str | None) -> str | None:
    """Which rank ended first and how, or under srun, which names no first, the tasks it reports ended badly."""
    if first or not first_to_end.srun_task_ends:
        return first
    return f"srun reported {'; '.join(first_to_end.srun_task_ends)}"


def _failure_line(script: str, code: int, first_to_end: FirstRankToEnd, first: str | None) -> str:
    """deepy.py's last line for a job that failed with exit status `code`, whose first rank to end `first` names."""
    if first_to_end.code == CLUSTER_CHECK_FAILED and Path(script).name == CLUSTER_CHECK_SCRIPT:
        return f"deepy.py: {script} found failures (exit status {code}): the summary above names them"
    if first_to_end.code == HUNG:
        return (f"deepy.py: {script} hung (exit status {code}): no step finished within hang_timeout; the 'hang:' "
                "line above names the ranks that did not arrive, and log_dir/hangs holds every rank's stack")
    cause = f"{first}; the errors of the other ranks follow from it" if first else \
        "the first error printed above is the cause"
    return f"deepy.py: {script} failed (the launcher exited {code}); {cause}"


def run_launcher(command: list[str], script: str, requested: list[int] | None = None) -> LaunchEnd:
    """Run the launcher `command` of `script`'s ranks to its end; its LaunchEnd, whose code is the launcher's (128+N
    for a signal N), that of the ranks a killed launcher left, or 128+N for a stop N that ended ranks still starting.

    The stop signals are this function's for the rest of the process, so that none ends deepy.py: one during the
    launcher's start is passed on once it has started, one after the ranks ended has nothing left to stop. Every
    stop is appended to `requested`, which a caller that launches again passes to each launch: a stop after one
    launch ended keeps the next from starting (launch/restarts.py)."""
    _become_subreaper()
    this_process = psutil.Process()
    requested = [] if requested is None else requested
    launcher: subprocess.Popen | None = None
    ended = False  # the ranks and what they started

    def pass_on(number: int) -> None:
        ranks = _local_ranks(this_process, script)
        if ranks:
            _stop(ranks, f"{signal.Signals(number).name} received", script)
        else:  # ranks on other hosts, or none yet: the launcher (srun, mpirun) forwards it to them
            launcher.send_signal(signal.SIGTERM)

    def stop(number: int, frame: object) -> None:
        requested.append(number)
        if ended:
            say(f"deepy.py: {signal.Signals(number).name} received after the ranks ended; nothing left to stop")
            return
        if launcher is not None:
            pass_on(number)

    for number in JOB_STOP_SIGNALS:
        signal.signal(number, stop)
    kills_before = oom_kill_counts()
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
    stopped = list(requested)  # before the ranks ended: a stop after that stopped none of them
    ended = True
    if code < 0:
        code = 128 - code
    first_to_end.wait()
    if code and stopped and Path(script).name == CLUSTER_CHECK_SCRIPT:
        name = signal.Signals(stopped[0]).name
        say(f"deepy.py: {script} stopped at your request ({name}); a report it began (cluster_check.md in "
             "log_dir) is marked INCOMPLETE")
        return LaunchEnd(128 + stopped[0])
    if code and stopped and first_to_end.code in (None, -signal.SIGTERM):
        # The stop reached ranks still starting (importing, compiling), before they could catch it and save.
        name = signal.Signals(stopped[0]).name
        say(f"deepy.py: {script} stopped at your request ({name}) while its ranks were starting, before they "
             "could save a checkpoint")
        return LaunchEnd(128 + stopped[0])
    if not code:
        return LaunchEnd(0)
    first = _first_to_end(first_to_end, kills_before)
    say(_failure_line(script, code, first_to_end, first))
    return LaunchEnd(code, _ended_badly(first_to_end, first))

"""deepy.py's part once the ranks run: pass a stop signal on to them, wait, and end on a line a person reads.

SIGTERM (a scheduler's stop, `kill`) or SIGINT (Ctrl-C) to deepy.py would end deepy.py alone, leaving the
ranks to train on unattached (DeepSpeed's runner does not forward it on one machine, and its per-node
launcher kills ranks after 30 s). So the launcher runs in a session of its own, and a signal to deepy.py is
sent on as SIGTERM to every rank on this machine, which saves a checkpoint at the next iteration boundary
and exits 0 (training/preemption.py); deepy.py then waits for the launcher to finish and exits with it.
Ranks on other hosts get it from the launcher (SIGTERM to srun or mpirun is forwarded to their tasks).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def runs_script(command_line: list[str], script: str) -> bool:
    """Whether `command_line` (python [options] SCRIPT args) runs `script`; the runners between deepy.py and
    the ranks run modules (`python -m deepspeed.launcher.launch ... train.py ...`) and do not."""
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


def run_launcher(command: list[str], script: str) -> int:
    """Run the launcher `command` of `script`'s ranks to its end; its exit code (128+N for a signal N)."""
    launcher = subprocess.Popen(command, start_new_session=True)
    parent = psutil.Process(launcher.pid)

    def stop(number: int, frame: object) -> None:
        ranks = _local_ranks(parent, script)
        target = f"its {len(ranks)} ranks here" if ranks else "the launcher"
        print(f"deepy.py: {signal.Signals(number).name} received; SIGTERM sent to {target}, which save a checkpoint "
              "and stop", file=sys.stderr, flush=True)
        for process in ranks or [parent]:
            try:
                process.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass

    previous = {number: signal.signal(number, stop) for number in STOP_SIGNALS}
    try:
        code = launcher.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    code = code if code >= 0 else 128 - code
    if code:
        print(f"deepy.py: {script} failed (the launcher exited {code}); the first error printed above is the cause",
              file=sys.stderr, flush=True)
    return code

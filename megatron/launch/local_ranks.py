"""Start a run's ranks on this machine, wait for them, and end the job when one of them fails.

    python -u -m megatron.launch.local_ranks --devices 0,1 --master_addr 127.0.0.1 --master_port P SCRIPT ARGS...

What DeepSpeed's runner and launcher.launch do for a one-machine run, in one process that imports neither torch
nor DeepSpeed (each of those two spends seconds importing both before any rank starts): the ranks get the same
variables and `--local_rank=N`. The first rank to end with a non-zero status ends the job: it is named
(FIRST_TO_END_LINE, which deepy.py reads), the others get SIGTERM, then SIGKILL, and this process exits with its
status (128+N for signal N). A stop signal is passed on to the ranks, which save and exit (training/preemption.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import psutil

from megatron.cli import JOB_STOP_SIGNALS

# The line naming the rank that ended first; deepy.py reads it (first_to_end.py).
FIRST_TO_END_LINE = "local_ranks: local rank {rank} ended first with return code = {code}; ending the others"
# How long the other ranks get to end on SIGTERM after one failed, before SIGKILL.
GRACE_SECONDS = 30
# Stops passed on as SIGTERM, which the ranks catch by default; the others (SIGUSR1, SIGUSR2) as they are.
AS_SIGTERM = (signal.SIGINT, signal.SIGHUP)


def rank_environment(devices: list[str], local_rank: int, master_addr: str, master_port: int,
                     visible_devices_variable: str) -> dict[str, str]:
    """The variables launcher.launch sets for a rank of a one-machine run."""
    return {
        "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(len(devices)),
        "LOCAL_SIZE": str(len(devices)), "CROSS_RANK": "0", "CROSS_SIZE": "1",
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        visible_devices_variable: ",".join(devices),
    }


def _end_tree(process: subprocess.Popen) -> list[psutil.Process]:
    """SIGTERM to a rank and what it started; the processes signalled."""
    try:
        root = psutil.Process(process.pid)
        tree = [*root.children(recursive=True), root]
    except psutil.Error:
        return []
    for member in tree:
        try:
            member.terminate()
            member.resume()  # SIGCONT: a stopped rank (the hang a watch named) acts on the SIGTERM only running
        except psutil.Error:
            pass
    return tree


def _running(process: psutil.Process) -> bool:
    """Alive and no zombie (a rank's child, once the rank is gone, waits as one for deepy.py to reap it)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _end_others(ranks: list[subprocess.Popen]) -> None:
    """SIGTERM to the ranks still running and what they started; SIGKILL to what is left after GRACE_SECONDS."""
    signalled = []
    for rank in ranks:
        if rank.returncode is None:
            signalled.extend(_end_tree(rank))
    deadline = time.monotonic() + GRACE_SECONDS
    while any(_running(process) for process in signalled) and time.monotonic() < deadline:
        time.sleep(0.05)
    for process in signalled:
        if _running(process):
            try:
                process.kill()
            except psutil.Error:
                pass
    for rank in ranks:
        rank.wait()


def run(devices: list[str], master_addr: str, master_port: int, visible_devices_variable: str,
        command: list[str]) -> int:
    """Start one rank per device running `command` (python options excluded), wait; the exit status."""
    ranks: list[subprocess.Popen] = []
    by_pid: dict[int, int] = {}
    stopping: list[int] = []

    def pass_on(number: int, frame: object) -> None:
        stopping.append(number)
        for rank in ranks:
            if rank.returncode is None:
                try:
                    rank.send_signal(signal.SIGTERM if number in AS_SIGTERM else number)
                except ProcessLookupError:
                    pass

    for number in JOB_STOP_SIGNALS:
        signal.signal(number, pass_on)
    for local_rank in range(len(devices)):
        environment = dict(os.environ, **rank_environment(devices, local_rank, master_addr, master_port,
                                                          visible_devices_variable))
        rank = subprocess.Popen([sys.executable, "-u", command[0], f"--local_rank={local_rank}", *command[1:]],
                                env=environment)
        ranks.append(rank)
        by_pid[rank.pid] = local_rank
    if stopping:  # a stop while the ranks were being started reaches those started after it too
        pass_on(stopping[0], None)
    while any(rank.returncode is None for rank in ranks):
        pid, status = os.wait()  # the first rank to end, at once (launcher.launch polls once a second)
        if pid not in by_pid:
            continue
        rank = ranks[by_pid[pid]]
        rank.returncode = os.waitstatus_to_exitcode(status)
        if rank.returncode != 0:
            print(FIRST_TO_END_LINE.format(rank=by_pid[pid], code=rank.returncode), flush=True)
            _end_others(ranks)
            return rank.returncode if rank.returncode > 0 else 128 - rank.returncode
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron.launch.local_ranks", description=__doc__.split("\n")[0])
    parser.add_argument("--devices", required=True, help="the devices of the ranks (the visible-devices variable's "
                        "ids), comma-separated")
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--visible_devices_variable", default="CUDA_VISIBLE_DEVICES",
                        help="the accelerator's variable that names the devices a rank sees")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="SCRIPT and its arguments")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no script given")
    return run(args.devices.split(","), args.master_addr, args.master_port, args.visible_devices_variable, args.command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

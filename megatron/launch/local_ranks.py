"""Start a run's ranks on this machine, wait for them, and end the job when one of them fails.

    python -u -m megatron.launch.local_ranks --devices 0,1 --master_addr 127.0.0.1 --master_port P SCRIPT ARGS...

What DeepSpeed's runner and its launcher.launch do for a run on one machine, in one process that imports
neither torch nor DeepSpeed: deepy.py starts this instead of those two (each a Python process importing both,
seconds before any rank starts). Each rank gets DeepSpeed's variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_ADDR, MASTER_PORT, the devices' visibility variable set to the
slots) and `--local_rank=N`, as launcher.launch gives them.

A rank that ends with a non-zero status ends the job: this process says which rank ended first and how (the
line supervise.py reads), ends the others (SIGTERM to each rank and what it started, SIGKILL after a grace
period) and exits with that status (128+N for signal N). SIGTERM or SIGUSR1 to this process is passed on to
each rank (SIGINT as SIGTERM), which saves a checkpoint and exits (training/preemption.py); it then exits as the
ranks do.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import psutil

# The line naming the rank that ended first; supervise.py reads it (FIRST_TO_END).
FIRST_TO_END_LINE = "local_ranks: local rank {rank} ended first with return code = {code}; ending the others"
# How long the other ranks get to end on SIGTERM after one failed, before SIGKILL.
GRACE_SECONDS = 30


def rank_environment(devices: list[int], local_rank: int, master_addr: str, master_port: int,
                     visible_devices_variable: str) -> dict[str, str]:
    """The variables launcher.launch sets for a rank of a one-machine run."""
    return {
        "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(len(devices)),
        "LOCAL_SIZE": str(len(devices)), "CROSS_RANK": "0", "CROSS_SIZE": "1",
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        visible_devices_variable: ",".join(map(str, devices)),
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
        except psutil.Error:
            pass
    return tree


def _running(process: psutil.Process) -> bool:
    """Alive and not a zombie: a rank's child that has ended waits as a zombie for deepy.py (its subreaper once
    the rank is gone) to reap it, which it does only when the job has ended."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _end_others(ranks: list[subprocess.Popen]) -> None:
    signalled = [member for rank in ranks if rank.returncode is None for member in _end_tree(rank)]
    deadline = time.monotonic() + GRACE_SECONDS
    while any(map(_running, signalled)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for member in filter(_running, signalled):
        try:
            member.kill()
        except psutil.Error:
            pass
    for rank in ranks:
        rank.wait()


def run(devices: list[int], master_addr: str, master_port: int, visible_devices_variable: str,
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
                    rank.send_signal(signal.SIGTERM if number == signal.SIGINT else number)
                except ProcessLookupError:
                    pass

    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
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
    parser.add_argument("--devices", required=True, help="the slots (device ids) of the ranks, comma-separated")
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--visible_devices_variable", default="CUDA_VISIBLE_DEVICES",
                        help="the accelerator's variable that names the devices a rank sees")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="SCRIPT and its arguments")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no script given")
    devices = [int(device) for device in args.devices.split(",")]
    return run(devices, args.master_addr, args.master_port, args.visible_devices_variable, args.command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

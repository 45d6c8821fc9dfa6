"""A stop signal to deepy.py reaches every rank (they save and exit 0, then deepy.py exits 0), and a second run
on the same save directory is refused before it starts, naming the run that holds it (real deepy.py launches,
real signals, the tiny config on 2 processes)."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron.launch.supervise import runs_script
from tests.conftest import REPO, run_deepy
from tests.distributed import free_port
from tests.test_training_e2e import data_overrides

pytestmark = pytest.mark.slow

TINY = str(REPO / "tests" / "tiny.yml")


def start_training(demo_data: Path, run: Path, *extra: str) -> subprocess.Popen:
    """deepy.py train.py for far more iterations than the test waits for, logging every iteration."""
    command = [sys.executable, "deepy.py", "train.py", TINY, *data_overrides(demo_data), "train_iters=2000",
               "lr_decay_iters=2000", "eval_interval=100000", "log_interval=1", f"save={run / 'checkpoints'}",
               f"load={run / 'checkpoints'}", f"log_dir={run / 'logs'}", f"master_port={free_port()}", *extra]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def trained_iterations(run: Path) -> int:
    metrics = run / "logs" / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    return max((json.loads(line)["iteration"] for line in metrics.read_text().splitlines() if line.strip()),
               default=0)


def wait_for_iteration(process: subprocess.Popen, run: Path, iteration: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while trained_iterations(run) < iteration:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no iteration {iteration} (exit {process.poll()}):\n{process.communicate()}")
        time.sleep(0.2)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_deepy_saves_on_every_rank_and_exits_0(demo_data, tmp_path, stop):
    run = tmp_path / "run"
    launcher = start_training(demo_data, run)
    wait_for_iteration(launcher, run, 3)
    descendants = psutil.Process(launcher.pid).children(recursive=True)
    ranks = [p for p in descendants if runs_script(p.cmdline(), "train.py")]
    assert len(ranks) == 2

    second = run_deepy("train.py", TINY, *data_overrides(demo_data), f"save={run / 'checkpoints'}",
                       f"log_dir={tmp_path / 'second'}", f"master_port={free_port()}", check=False, timeout=120)
    assert second.returncode == 2 and "launching" not in second.stdout
    assert (f"save = '{run / 'checkpoints'}' is in use by another run (pid " in second.stderr
            and f"train.py {TINY})" in second.stderr), second.stderr

    launcher.send_signal(stop)
    stdout, stderr = launcher.communicate(timeout=180)
    assert launcher.returncode == 0, stdout + stderr
    stopped_at = trained_iterations(run)
    assert f"exiting after iteration {stopped_at}: SIGTERM received" in stdout, stdout
    assert (run / "checkpoints" / "latest").read_text().strip() == f"global_step{stopped_at}"
    assert stopped_at < 2000 and not [p for p in descendants if p.is_running() and p.status() != "zombie"]


def test_a_lock_left_by_a_killed_run_does_not_hold_the_next_one(demo_data, tmp_path):
    run = tmp_path / "run"
    launcher = start_training(demo_data, run)
    wait_for_iteration(launcher, run, 2)
    for process in [launcher, *psutil.Process(launcher.pid).children(recursive=True)]:
        process.kill()  # SIGKILL: nothing runs on the way out
    launcher.communicate()
    assert (run / "checkpoints" / ".lock").is_file()
    resumed = run_deepy("train.py", TINY, *data_overrides(demo_data), "train_iters=4", "lr_decay_iters=4",
                        "eval_iters=0", f"save={run / 'checkpoints'}", f"log_dir={run / 'logs'}",
                        f"master_port={free_port()}", timeout=300)
    assert "exiting" not in resumed.stdout and (run / "checkpoints" / "latest").read_text().strip() == "global_step4"


def test_ranks_orphaned_by_a_killed_starter_are_stopped_and_save(demo_data, tmp_path):
    """SIGKILL to the process between deepy.py and its ranks (here local_ranks.py; srun or mpirun elsewhere)
    leaves the ranks to deepy.py, their subreaper, which passes the stop on and exits with them."""
    run = tmp_path / "run"
    launcher = start_training(demo_data, run)
    wait_for_iteration(launcher, run, 3)
    [starter] = [p for p in psutil.Process(launcher.pid).children() if "megatron.launch.local_ranks" in p.cmdline()]
    starter.send_signal(signal.SIGKILL)
    stdout, stderr = launcher.communicate(timeout=180)
    assert launcher.returncode == 0, stdout + stderr
    assert "deepy.py: the launcher was ended by SIGKILL; SIGTERM sent to the 2 ranks here" in stderr
    stopped_at = trained_iterations(run)
    assert (run / "checkpoints" / "latest").read_text().strip() == f"global_step{stopped_at}"


@pytest.mark.parametrize("hostfile", [False, True], ids=["local", "hostfile"])
def test_ranks_stop_and_save_when_deepy_is_killed(demo_data, tmp_path, hostfile):
    """A SIGKILL of deepy.py stops its ranks, which save: otherwise they would train on unattended, holding the save
    lock and the port."""
    run = tmp_path / "run"
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    launcher = start_training(demo_data, run, *([f"hostfile={tmp_path / 'hostfile'}"] if hostfile else []))
    wait_for_iteration(launcher, run, 3)
    ranks = [p for p in psutil.Process(launcher.pid).children(recursive=True) if runs_script(p.cmdline(), "train.py")]
    assert len(ranks) == 2
    launcher.kill()
    launcher.wait()
    _, alive = psutil.wait_procs(ranks, timeout=120)
    assert not alive, [p.cmdline()[:3] for p in alive]
    stopped_at = trained_iterations(run)
    assert stopped_at < 2000
    assert (run / "checkpoints" / "latest").read_text().strip() == f"global_step{stopped_at}"
    launcher.communicate(timeout=60)


def test_a_stop_during_start_up_says_so_exits_130_and_ends_what_the_ranks_started(demo_data, tmp_path):
    """A start stopped while DeepSpeed compiles its op is reported as a stop, not as a failure ("the launcher exited
    241 ... killed by SIGTERM"), and the compilers the ranks started end at once instead of running on as orphans.
    The ranks here catch no signal, as ranks still starting do not."""
    pids = tmp_path / "children"
    command = [sys.executable, "deepy.py", "tests/scripts/rank_check.py", TINY, *data_overrides(demo_data),
               f"master_port={free_port()}"]
    launcher = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", CHILD_PID_FILE=str(pids)))
    deadline = time.monotonic() + 180
    while not (pids.is_file() and len(pids.read_text().split()) == 2):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.2)
    children = [psutil.Process(int(pid)) for pid in pids.read_text().split()]
    launcher.send_signal(signal.SIGINT)
    stopped = time.monotonic()
    _, errors = launcher.communicate(timeout=120)
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive and time.monotonic() - stopped < 30, (time.monotonic() - stopped, errors)
    assert launcher.returncode == 130, errors
    assert errors.splitlines()[-1] == ("deepy.py: tests/scripts/rank_check.py stopped at your request (SIGINT) while "
                                       "its ranks were starting, before they could save a checkpoint")


def test_two_runs_started_together_on_one_port_never_mix(demo_data, tmp_path):
    """Two runs started together on one port: one trains; the other stops with a clear message, never with a rank
    joined to the other run's rendezvous (a busy-port check alone can pass both)."""
    port = free_port()

    def start(name: str) -> subprocess.Popen:
        command = [sys.executable, "deepy.py", "train.py", TINY, *data_overrides(demo_data), "train_iters=4",
                   "lr_decay_iters=4", "eval_iters=0", f"save={tmp_path / name}", f"log_dir={tmp_path / name}-logs",
                   f"master_port={port}"]
        return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))

    runs = [start("a"), start("b")]
    outputs = [run.communicate(timeout=300) for run in runs]
    codes = [run.returncode for run in runs]
    assert sorted(code == 0 for code in codes) == [False, True], outputs
    _, stderr = outputs[codes.index(next(code for code in codes if code))]
    assert (f"master_port {port} is in use on this machine" in stderr
            or f"master_port {port} on 127.0.0.1 was taken by another program after deepy.py found it free" in stderr
            or f"reached the rendezvous of another run at 127.0.0.1:{port}" in stderr), stderr
    winner = "ab"[codes.index(0)]
    assert (tmp_path / winner / "latest").read_text().strip() == "global_step4"


def test_a_rank_that_meets_another_runs_store_stops_on_the_launch_id(demo_data, tmp_path):
    """In the case above the second run may be stopped by preflight's busy-port check, or by its rank 0 finding the
    port taken, before any rank compares launch ids. Here only the launch id can tell: run B is past
    its checks while the port is free, its rank 0 starts late ($WAIT_RANK), and its rank 1 meets the store of run
    A, which took the port meanwhile. B stops, having registered nothing; A trains."""
    port = free_port()
    late = subprocess.Popen([sys.executable, "deepy.py", "tests/scripts/rank_check.py", TINY, *data_overrides(demo_data),
                             f"master_port={port}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1", WAIT_RANK="0"))
    try:
        assert any(line.startswith("launching 2 processes") for line in late.stdout), late.communicate()
        first = run_deepy("train.py", TINY, *data_overrides(demo_data), "train_iters=4", "lr_decay_iters=4",
                          "eval_iters=0", f"save={tmp_path / 'a'}", f"log_dir={tmp_path / 'a-logs'}",
                          f"master_port={port}", timeout=300)
        _, stderr = late.communicate(timeout=120)
    finally:
        if late.poll() is None:  # a rank that joined A's store waits there: stop B and its ranks (SIGTERM passed on)
            late.terminate()
            late.communicate(timeout=60)
    assert late.returncode != 0 and f"rank 1 reached the rendezvous of another run at 127.0.0.1:{port}" in stderr
    assert "is in use on this machine" not in stderr and "was taken by another program" not in stderr, stderr
    assert "launching" in first.stdout and (tmp_path / "a" / "latest").read_text().strip() == "global_step4"


def test_a_run_that_names_no_port_gets_a_free_one(demo_data, tmp_path):
    command = [sys.executable, "deepy.py", "train.py", TINY, *data_overrides(demo_data), "train_iters=2",
               "lr_decay_iters=2", "eval_iters=0", f"log_dir={tmp_path / 'logs'}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    port = int(re.search(r"--master_port (\d+)", result.stdout)[1])
    assert port != 29500 and 20000 <= port


def wait_until_it_catches(process: subprocess.Popen, number: int, timeout: float = 60) -> None:
    """Until `process` has a handler for signal `number` (/proc/PID/status, SigCgt): the sign that deepy.py has
    installed its own, which it does before its imports."""
    deadline = time.monotonic() + timeout
    while True:
        status = Path(f"/proc/{process.pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught & 1 << (number - 1):
            return
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.002)


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM", "SIGUSR1", "SIGHUP"])
def test_a_stop_while_deepy_imports_and_checks_is_one_line_not_a_traceback(demo_data, name):
    """A stop (Ctrl-C, a scheduler's SIGTERM or SIGUSR1, a hang-up) as soon as deepy.py can take it, while it
    imports torch and DeepSpeed: one line saying it stopped as asked, exit 128+N, nothing launched, and nothing
    unwound. Unwinding from inside an import can leave numpy half-imported for preflight (a second traceback,
    exit 1) or cross pybind11 (`terminate called ... error_already_set`, exit 134); the atexit hook below stands
    for any code that unwinding would run."""
    deepy = [str(REPO / "deepy.py"), "train.py", TINY, *data_overrides(demo_data), f"master_port={free_port()}"]
    wrapper = ("import atexit, runpy, sys\n"
               "atexit.register(lambda: print('unwound', file=sys.stderr))\n"
               f"sys.argv = {deepy!r}\n"
               "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    launcher = subprocess.Popen([sys.executable, "-c", wrapper], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    # Python catches SIGINT from its start: deepy.py's own handler shows on the others
    wait_until_it_catches(launcher, signal.SIGTERM if name == "SIGINT" else getattr(signal, name))
    launcher.send_signal(getattr(signal, name))
    output, errors = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + getattr(signal, name), errors
    assert errors.splitlines() == ["deepy.py: stopped at your request, before any process started"], errors
    assert "launching" not in output


# Loaded into deepy.py (sitecustomize): its launcher becomes a stand-in that sleeps, whose pid goes to
# $LAUNCHER_PID_FILE, and deepy.py sends itself SIGINT as soon as the launcher has started.
STOP_AS_THE_LAUNCHER_STARTS = """
import os, signal, subprocess, sys

class Launcher(subprocess.Popen):
    def __init__(self, args, *rest, **options):
        launcher = options.get("start_new_session") and "megatron.launch.local_ranks" in args
        if launcher:
            args = [sys.executable, "-c", "import time; time.sleep(120)"]
        super().__init__(args, *rest, **options)
        if launcher:
            with open(os.environ["LAUNCHER_PID_FILE"], "w") as pid_file:
                pid_file.write(str(self.pid))
            os.kill(os.getpid(), signal.SIGINT)

subprocess.Popen = Launcher
"""


def test_a_stop_just_after_the_launcher_starts_is_passed_on_to_it(demo_data, tmp_path):
    """Not "before any process started", nor deepy.py exiting and leaving the launcher and its ranks to the ranks'
    orphan watch: the stop is passed on to the launcher. (After the ranks ended: tests/test_supervise.py.)"""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STOP_AS_THE_LAUNCHER_STARTS)
    pid_file = tmp_path / "launcher.pid"
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
                       LAUNCHER_PID_FILE=str(pid_file), PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "deepy.py", "tests/scripts/rank_check.py", TINY, *data_overrides(demo_data),
                           f"master_port={free_port()}"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=environment)
    launcher = int(pid_file.read_text())
    try:
        assert done.returncode == 130 and not psutil.pid_exists(launcher), done.stderr
        assert done.stderr.splitlines()[-1] == (
            "deepy.py: tests/scripts/rank_check.py stopped at your request (SIGINT) while its ranks were starting, "
            "before they could save a checkpoint")
    finally:
        if psutil.pid_exists(launcher):
            os.kill(launcher, signal.SIGKILL)

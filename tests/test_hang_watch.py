"""A hang while steps run ends the job within hang_timeout + 60 s, naming the rank that did not arrive, with every
live rank's stack written (a real deepy.py launch of the tiny config on 2 processes, one rank SIGSTOPped
mid-run); the first step and paused work (evaluation, saves) do not trip the watch, and a peer stopped while a
rank is paused does (two forked gloo ranks). The cluster check (two forked gloo ranks running run_cluster_check
each): a rank that raises in throughput, or is stopped in collectives, fails that section naming it within
hang_timeout, and the check ends; a rank that raises after the others left the section fails it and the check
goes on."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from megatron.cluster_check import collectives, environment, throughput
from megatron.cluster_check.check import REPORT_NAME, run_cluster_check
from megatron.config import load_config
from megatron.config.run_inputs import CLUSTER_CHECK_FAILED, HUNG
from megatron.launch.supervise import runs_script
from megatron.runtime.hang_watch import HangWatch
from tests.distributed import start_ranks
from tests.test_launch_signals import TINY, start_training, wait_for_iteration
from tests.test_training_e2e import data_overrides

pytestmark = pytest.mark.slow

HANG_TIMEOUT = 5
PAUSE_TIMEOUT = 2.0  # the forked ranks' watch
CHECK_TIMEOUT = 3.0  # the cluster check's


def _rank_process(launcher_pid: int, local_rank: int) -> psutil.Process:
    for process in psutil.Process(launcher_pid).children(recursive=True):
        command = process.cmdline()
        if runs_script(command, "train.py") and f"--local_rank={local_rank}" in command:
            return process
    raise AssertionError(f"no rank {local_rank} under deepy.py")


def test_a_stopped_rank_ends_the_job_named_within_hang_timeout(demo_data, tmp_path):
    run = tmp_path / "run"
    launcher = start_training(demo_data, run, f"hang_timeout={HANG_TIMEOUT}", "save=null", "load=null")
    wait_for_iteration(launcher, run, 3)
    descendants = psutil.Process(launcher.pid).children(recursive=True)
    stopped = _rank_process(launcher.pid, 1)
    try:
        stopped.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        stdout, stderr = launcher.communicate(timeout=HANG_TIMEOUT + 60)
        seconds = time.monotonic() - start
    finally:  # nothing is left when the watch works
        for process in [stopped, *descendants]:
            with contextlib.suppress(psutil.Error):
                process.kill()
        launcher.kill()
    assert launcher.returncode == HUNG, stdout + stderr
    assert seconds < HANG_TIMEOUT + 60
    line = next(line for line in stderr.splitlines() if line.startswith("hang: "))
    host = socket.gethostname()
    assert f"Did not arrive: rank 1 on {host} (its heartbeat stopped" in line, line
    assert "rank 0 on" not in line.split("Did not arrive:")[1].split(". Rank 0")[0], line
    assert f"Rank 0 on {host} waited in " in line, line
    assert "deepy.py: train.py hung (exit status 124)" in stderr, stderr
    stacks = (run / "logs" / "hangs" / "rank0.stacks.txt").read_text()
    assert "Thread" in stacks and "pretrain.py" in stacks, stacks


def _pause_then_stop(log_dir: Path) -> None:
    """Rank body: a first step and a paused stretch longer than hang_timeout, then rank 1 stops itself while rank 0
    waits for it paused (an evaluation's collective): rank 0's watch must name rank 1 and end the process."""
    phase = ["first step"]

    def at_hang(line: str, absent: dict[int, str]) -> None:
        (log_dir / "hang.json").write_text(json.dumps({"phase": phase[0], "line": line, "absent": absent}))

    watch = HangWatch(PAUSE_TIMEOUT, log_dir, at_hang=at_hang)
    time.sleep(PAUSE_TIMEOUT + 1)  # the first step (compilation): not armed yet
    watch.step_done(1)
    phase[0] = "paused"
    with watch.paused():
        time.sleep(PAUSE_TIMEOUT + 1)  # an evaluation or a save
    watch.step_done(2)
    dist.barrier()
    phase[0] = "rank 1 stopped"
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    with watch.paused():
        dist.barrier()


def end_of_ranks(processes: list, timeout: float) -> list[int | None]:
    """The ranks' exit codes once rank 0 ended or `timeout` passed (None: still running, then killed)."""
    processes[0].join(timeout)
    for process in processes[1:]:
        process.join(1)
    codes = [process.exitcode for process in processes]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    return codes


def test_the_first_step_and_paused_work_do_not_trip_the_watch_and_a_peer_stopped_meanwhile_does(tmp_path):
    processes, _ = start_ranks(2, _pause_then_stop, tmp_path)
    codes = end_of_ranks(processes, timeout=3 * PAUSE_TIMEOUT + 30)
    hang = json.loads((tmp_path / "hang.json").read_text())
    assert codes[0] == HUNG and hang["phase"] == "rank 1 stopped", (codes, hang)
    assert hang["absent"] == {"1": "its heartbeat stopped: the process is stopped or dead"}, hang
    assert f"Did not arrive: rank 1 on {socket.gethostname()} (its heartbeat stopped" in hang["line"], hang


def _cluster_check_with_a_fault(data: list[str], log_dir: Path, sections: str, fault: Callable[[], None]) -> None:
    """Rank body: cluster_check.py's run of `sections`, `fault` set up on rank 1 (it records when it struck); the
    process exits with the check's status, as cluster_check.py's would."""
    cfg = load_config([TINY], [*data, "num_gpus=2", f"log_dir={log_dir}", f"cluster_check_sections={sections}",
                               f"hang_timeout={CHECK_TIMEOUT}"], world_size=2)
    if dist.get_rank() == 1:
        fault()
    os._exit(run_cluster_check(cfg))


def _struck(log_dir: Path) -> None:
    (log_dir / "struck").write_text(str(time.time()))


def _raise_in_throughput(log_dir: Path) -> None:
    def out_of_memory(*args: object) -> None:
        _struck(log_dir)
        raise RuntimeError("CUDA out of memory (injected)")

    throughput.engine_for = out_of_memory


def _raise_after_the_environment(log_dir: Path) -> None:
    checked = environment.run

    def raise_when_done(context: object) -> None:
        checked(context)
        _struck(log_dir)
        raise RuntimeError("a fault after the section's last collective (injected)")

    environment.run = raise_when_done


def _stop_in_collectives(log_dir: Path) -> None:
    def stopped(*args: object) -> None:
        _struck(log_dir)
        os.kill(os.getpid(), signal.SIGSTOP)

    collectives._correct = stopped


@pytest.mark.parametrize("sections, fault, section, finding, after", [
    ("[throughput]", _raise_in_throughput, "throughput", "raised RuntimeError: CUDA out of memory (injected)", None),
    ("[collectives, throughput]", _stop_in_collectives, "collectives",
     "its heartbeat stopped: the process is stopped or dead", "## throughput: SKIP\n\nnot run: the check ended in "
                                                              "collectives"),
    ("[environment, collectives]", _raise_after_the_environment, "environment",
     "raised RuntimeError: a fault after the section's last collective (injected)", "## collectives: PASS"),
], ids=["raise_in_throughput", "stop_in_collectives", "raise_then_go_on"])
def test_a_rank_that_raises_or_stops_inside_a_section_fails_it_named_within_hang_timeout(
        demo_data, tmp_path, sections, fault, section, finding, after):
    processes, _ = start_ranks(2, _cluster_check_with_a_fault, data_overrides(demo_data), tmp_path, sections,
                               lambda: fault(tmp_path))
    codes = end_of_ranks(processes, timeout=120)
    report = tmp_path / REPORT_NAME
    seconds = report.stat().st_mtime - float((tmp_path / "struck").read_text())
    text = report.read_text()
    assert codes[0] == CLUSTER_CHECK_FAILED, (codes, text)
    assert text.startswith("# Cluster check: FAIL"), text
    assert f"## {section}: FAIL" in text, text
    assert f"rank 1 on {socket.gethostname()}" in text and finding in text, text
    assert seconds < CHECK_TIMEOUT + 10, seconds
    assert after is None or after in text, text

"""Restarts inside the job: deepy.py's loop (launch/restarts.py over local_ranks.py) against torchrun's elastic
agent (LocalElasticAgent, --max-restarts), on 2 ranks of a script that imports nothing heavy.

    .venv/bin/python -m benchmarks.restart_launchers [--repeats 3]

Each engine runs the script with one restart allowed: on the first attempt rank 1 SIGKILLs itself, on the second
both ranks exit 0. Timed (median of --repeats): from the engine's start to both ranks running, from the kill to both
ranks of the restart running, and the whole run; then, with no restart allowed, the engine's exit status for the
SIGKILLed rank (deepy.py's 128+N against torchrun's 1). docs/reliability.md, "Restarts inside the job", has the
behaviours a timing does not show (SIGUSR1, a stop during the start).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
# OUT/<attempt>-<rank>: when the rank started; OUT/killed: when rank 1 of the first attempt killed itself.
RANK = """
import os, signal, sys, time
out, rank = sys.argv[-1], os.environ["LOCAL_RANK"]
attempt = 2 if os.path.exists(os.path.join(out, "killed")) else 1
open(os.path.join(out, f"{attempt}-{rank}"), "w").write(repr(time.time()))
if attempt == 1 and rank == "1":
    time.sleep(0.5)  # both ranks run
    open(os.path.join(out, "killed"), "w").write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.5 if attempt == 2 else 60)
"""
# deepy.py's last step (launch/restarts.py) with max_restarts from the first argument.
DEEPY = """
import sys
from megatron.config import load_config
from megatron.launch.restarts import run_with_restarts
save = sys.argv[2]
cfg = load_config([sys.argv[1]], [f"max_restarts={sys.argv[3]}", f"save={save}", f"load={save}"], world_size=2)
sys.exit(run_with_restarts(cfg, sys.argv[4:], sys.argv[-2]))
"""


def command(engine: str, script: Path, out: Path, restarts: int) -> list[str]:
    if engine == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
                str(restarts), "--master-port", str(free_port()), str(script), str(out)]
    launcher = [sys.executable, "-u", "-m", "megatron.launch.local_ranks", "--devices", "0,1", "--master_port",
                str(free_port()), str(script), str(out)]
    return [sys.executable, "-c", DEEPY, str(REPO / "tests" / "tiny.yml"), str(out / "checkpoints"), str(restarts),
            *launcher]


def run(engine: str, script: Path, out: Path, restarts: int) -> tuple[float, float, float, int]:
    """Seconds to both ranks running, from the kill to the restart's ranks running, in all; the exit status."""
    out.mkdir()
    start = time.time()
    ended = subprocess.run(command(engine, script, out, restarts), cwd=REPO, capture_output=True)
    total = time.time() - start

    def started(attempt: int) -> float:
        return max(float((out / f"{attempt}-{rank}").read_text()) for rank in (0, 1))

    restart = started(2) - float((out / "killed").read_text()) if restarts else float("nan")
    return started(1) - start, restart, total, ended.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as work:
        script = Path(work) / "rank.py"
        script.write_text(RANK)
        for engine in ("deepy.py", "torchrun"):
            runs = [run(engine, script, Path(work) / f"{engine}-{n}", 1) for n in range(args.repeats)]
            status = run(engine, script, Path(work) / f"{engine}-no-restart", 0)[3]
            rows[engine] = [statistics.median(column) for column in list(zip(*runs))[:3]] + [status]
    print("| engine | start to ranks running (s) | kill to restarted ranks running (s) | whole run (s) | "
          "exit status, SIGKILLed rank, no restart left |")
    print("| --- | --- | --- | --- | --- |")
    for engine, (start, restart, total, status) in rows.items():
        print(f"| {engine} | {start:.2f} | {restart:.2f} | {total:.2f} | {status} |")
    print(f"restart turnaround, deepy.py / torchrun: {rows['deepy.py'][1] / rows['torchrun'][1]:.1f}x")


if __name__ == "__main__":
    main()

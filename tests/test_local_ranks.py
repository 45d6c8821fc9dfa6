"""megatron/launch/local_ranks.py: the ranks of a one-machine run see what DeepSpeed's launcher.launch gives
them, a failing rank ends the job, and a stop reaches every rank.

The ranks here are small Python scripts; deepy.py launches through the starter in test_rank_failure.py,
test_launch_signals.py and every end-to-end test.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.launch.local_ranks import FIRST_TO_END_LINE
from megatron.launch.first_to_end import FIRST_TO_END

REPO = Path(__file__).resolve().parents[1]
VARIABLES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "CUDA_VISIBLE_DEVICES"]
# Writes its arguments and DeepSpeed's variables to OUT/<LOCAL_RANK>.json.
DUMP = f"""
import json, os, sys
names = {VARIABLES!r}
with open(os.path.join(os.environ["OUT"], os.environ["LOCAL_RANK"] + ".json"), "w") as out:
    json.dump({{"argv": sys.argv[1:], "env": {{name: os.environ.get(name) for name in names}}}}, out)
"""


def start(tmp_path: Path, body: str, *, devices: str = "0,1", **environment: str) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(body)
    command = [sys.executable, "-m", "megatron.launch.local_ranks", "--devices", devices, "--master_port", "29511",
               str(script), "--flag", "x"]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OUT=str(tmp_path), **environment))


def dumps(directory: Path, ranks: int) -> list[dict]:
    return [json.loads((directory / f"{rank}.json").read_text()) for rank in range(ranks)]


def test_ranks_get_what_deepspeeds_launcher_gives_them(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    starter = start(ours, DUMP, devices="1,3")
    assert starter.wait(timeout=60) == 0, starter.communicate()
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": [1, 3]}).encode()).decode()
    subprocess.run([sys.executable, "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
                    "--master_addr=127.0.0.1", "--master_port=29511", str(ours / "rank.py"), "--flag", "x"],
                   check=True, capture_output=True, env=dict(os.environ, OUT=str(theirs)), timeout=120)
    assert dumps(ours, 2) == dumps(theirs, 2)
    assert dumps(ours, 2)[1] == {
        "argv": ["--local_rank=1", "--flag", "x"],
        "env": {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "CROSS_RANK": "0",
                "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "CUDA_VISIBLE_DEVICES": "1,3"},
    }


def test_a_failing_rank_ends_the_others_at_once_and_is_named(tmp_path):
    body = "import os, sys, time\nif os.environ['LOCAL_RANK'] == '2': sys.exit(3)\ntime.sleep(300)\n"
    started = time.monotonic()
    starter = start(tmp_path, body, devices="0,1,2")
    stdout, _ = starter.communicate(timeout=60)
    assert time.monotonic() - started < 30  # the others get SIGTERM, not the 300 s they asked for
    assert starter.returncode == 3
    assert FIRST_TO_END_LINE.format(rank=2, code=3) in stdout
    match = FIRST_TO_END.search(stdout)
    assert (match["local"], match["code"]) == ("2", "3")


def test_a_rank_killed_by_a_signal_exits_the_starter_with_128_plus_n(tmp_path):
    body = "import os, signal, time\nif os.environ['LOCAL_RANK'] == '0': os.kill(os.getpid(), signal.SIGKILL)\n" \
           "time.sleep(300)\n"
    starter = start(tmp_path, body)
    stdout, _ = starter.communicate(timeout=60)
    assert starter.returncode == 128 + signal.SIGKILL
    assert FIRST_TO_END_LINE.format(rank=0, code=-signal.SIGKILL) in stdout


@pytest.mark.parametrize(("sent", "received"), [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM),
                                                (signal.SIGUSR1, signal.SIGUSR1)])
def test_a_stop_to_the_starter_reaches_every_rank_which_ends_as_it_chooses(tmp_path, sent, received):
    """A stop signal to the starter is passed on to each rank (SIGINT as SIGTERM), which saves and exits 0."""
    body = ("import os, signal, sys, time\n"
            "def saved(number, frame):\n"
            "    with open(os.path.join(os.environ['OUT'], os.environ['LOCAL_RANK'] + '.saved'), 'w') as out:\n"
            "        out.write(str(number))\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, saved)\n"
            "signal.signal(signal.SIGUSR1, saved)\n"
            "open(os.path.join(os.environ['OUT'], os.environ['LOCAL_RANK'] + '.ready'), 'w').close()\n"
            "time.sleep(300)\n")
    starter = start(tmp_path, body)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"{rank}.ready").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline and starter.poll() is None, starter.communicate()
        time.sleep(0.05)
    starter.send_signal(sent)
    assert starter.wait(timeout=60) == 0, starter.communicate()
    assert [(tmp_path / f"{rank}.saved").read_text() for rank in (0, 1)] == [str(int(received))] * 2

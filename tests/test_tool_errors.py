"""The command-line tools end on bad input and on Ctrl-C with one line, not a traceback or a raw `[Errno N]`:
megatron/cli.py's decorator, OSError wording and stop during imports, shared by the tools;
output directories under a file refused before any work (checkpoint/output_directory.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

from benchmarks import framework_step
from data_prep import demo_corpus, markov_corpus
from megatron.cli import one_line_errors
from tests.conftest import REPO
from tests.test_launch_preflight import pristine, run  # noqa: F401 - fixtures: a synthetic checkpoint
from tools import grow_checkpoint, model_summary, plot_metrics, preprocess_data

TINY = str(REPO / "tests" / "tiny.yml")


def one_line(capsys, call) -> tuple[int, str]:
    """The exit status of `call` and the one line it printed on stderr (argparse's usage lines left out)."""
    with pytest.raises(SystemExit) as exit_:
        call()
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.strip() and not line.startswith(("usage:", " "))]
    assert len(lines) == 1, lines
    return exit_.value.code, lines[0]


@pytest.fixture
def a_file(tmp_path) -> Path:
    (tmp_path / "notes").write_text("")
    return tmp_path / "notes"


def test_model_summary_reports_bad_input_in_one_line(tmp_path, capsys):
    duplicate = tmp_path / "twice.yml"
    duplicate.write_text("num_layers: 2\nnum_layers: 3\n")
    cases = [([str(tmp_path / "missing.yml")], f"model_summary.py: error: config file {tmp_path}/missing.yml does "
                                                "not exist"),
             ([str(duplicate)], f"model_summary.py: error: config file {duplicate} is not valid YAML: key "
                                "'num_layers' is given twice, on lines 1 and 2"),
             ([TINY, "--vocab-size", "-1"], "error: argument --vocab-size: must be at least 1, got -1")]
    for argv, expected in cases:
        code, line = one_line(capsys, lambda: model_summary.main(argv))
        assert code == 2 and expected in line, line  # argparse's lines begin with sys.argv[0]
    model_summary.main([TINY, "num_layers=3", "--json"])  # key=value overrides a key, as deepy.py's do
    assert '"total_params"' in capsys.readouterr().out


def test_a_bug_shows_its_traceback_and_asks_for_a_report_while_a_full_disk_stays_one_line(capsys):
    """A ValueError from inside numpy, or an OSError about no path of the user's, is a bug: read as bad input, it
    would hide where it came from. A full disk is the user's, path or not (a write to /dev/full fails so)."""
    bug_line = "tool.py: this is a bug, not bad input: please report it with the traceback above"

    @one_line_errors("tool.py")
    def misuses_numpy() -> None:
        numpy.zeros(-1)

    @one_line_errors("tool.py")
    def reads_a_closed_descriptor() -> None:
        descriptor = os.open(os.devnull, os.O_RDONLY)
        os.close(descriptor)
        os.read(descriptor, 1)

    @one_line_errors("tool.py")
    def writes_to_a_full_disk() -> None:
        with open("/dev/full", "w") as out:
            out.write("x")

    for main, error in [(misuses_numpy, "ValueError: negative dimensions are not allowed"),
                        (reads_a_closed_descriptor, "OSError: [Errno 9] Bad file descriptor")]:
        with pytest.raises(SystemExit) as exit_:
            main()
        lines = capsys.readouterr().err.splitlines()
        assert exit_.value.code == 1 and lines[0] == "Traceback (most recent call last):", lines
        assert lines[-2:] == [error, bug_line], lines
    assert one_line(capsys, writes_to_a_full_disk) == (2, "tool.py: error: No space left on device")


def test_an_output_under_a_file_is_one_line_naming_the_file(tmp_path, a_file, capsys):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text('{"iteration": 1, "split": "train", "lm_loss": 1.0}\n')
    blocked = f"{a_file} is a file, not a directory; choose another path"
    for program, call in [("plot_metrics.py", lambda: plot_metrics.main([str(tmp_path / "logs"), "--out",
                                                                         str(a_file / "m.png")])),
                          ("markov_corpus.py", lambda: markov_corpus.main(["--out", str(a_file / "m"),
                                                                           "--tokens", "4096"])),
                          ("demo_corpus.py", lambda: demo_corpus.main(["--out", str(a_file / "d"),
                                                                       "--max-docs", "5"]))]:
        code, line = one_line(capsys, call)
        assert code == 2 and line.startswith(f"{program}: error: ") and line.endswith(blocked), line


def test_preprocess_with_its_output_prefix_under_a_file_says_so(tmp_path, a_file, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    code = preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(a_file / "corpus"),
                                 "--tokenizer-type", "CharLevelTokenizer", "--no-progress"])
    assert code == 1 and capsys.readouterr().err == (
        f"error: {a_file} is a file, where a directory is needed; choose another path\n")


def test_grow_with_save_under_a_file_is_refused_before_reading_the_source(run, tmp_path, a_file, capsys):  # noqa: F811
    """Refused before any work, naming the file, not found only when the grown checkpoint is written, as
    `[Errno 20] Not a directory`."""
    layout = tmp_path / "layout.yml"  # the synthetic checkpoint's (tests/test_launch_preflight.py)
    layout.write_text("tokenizer_type: CharLevelTokenizer\nbf16: {enabled: true}\npipe_parallel_size: 1\n"
                      "zero_optimization: {stage: 1}\n")
    code, line = one_line(capsys, lambda: grow_checkpoint.main(["--load", str(run), "--save", str(a_file / "grown"),
                                                                "--config", TINY, str(layout)]))
    assert code == 2 and line.endswith(f": error: --save {a_file}/grown cannot be created: {a_file} is a file, not a "
                                       "directory; choose another path"), line


def test_framework_step_names_an_unknown_set_key_before_building_anything(capsys):
    code, line = one_line(capsys, lambda: framework_step.main(["--set", "no_such_key=1"]))
    assert code == 2 and line.endswith("error: --set: unknown key 'no_such_key'; did you mean 'no_ssh_check'?")


def test_ctrl_c_while_grow_checkpoint_imports_is_one_line(tmp_path):
    """One line, not KeyboardInterrupt's traceback from inside torch's import."""
    tool = subprocess.Popen([sys.executable, "tools/grow_checkpoint.py", "--load", str(tmp_path), "--save",
                             str(tmp_path / "grown"), "--config", TINY], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while "libtorch_cpu" not in Path(f"/proc/{tool.pid}/maps").read_text():  # a sign it is importing torch
        assert tool.poll() is None and time.monotonic() < deadline, tool.communicate()
        time.sleep(0.002)
    tool.send_signal(signal.SIGINT)
    _, errors = tool.communicate(timeout=60)
    assert tool.returncode == 130 and errors.splitlines() == [
        "grow_checkpoint.py: stopped at your request, before anything was written"], errors


def test_the_pattention_benchmark_refuses_no_tokens(monkeypatch, capsys):
    """--tokens 0 is refused in argparse's line, not run with the value ignored."""
    from benchmarks import pattention

    monkeypatch.setattr(sys, "argv", ["pattention.py", "--tokens", "0"])
    monkeypatch.setattr(pattention, "host_proxy", lambda *args: pytest.fail("the benchmark ran"))
    code, line = one_line(capsys, pattention.main)
    assert code == 2 and line == "pattention.py: error: argument --tokens: must be at least 1, got 0"

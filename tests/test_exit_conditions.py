"""exit_interval and exit_duration_in_mins end a run on 2 gloo ranks cleanly, with a checkpoint where it
stopped; exit_signals only accepts signals a process can catch. (Preemption signals themselves are sent to
real processes in test_crash_resume.py.)"""

from __future__ import annotations

import signal

import pytest

from megatron.checkpoint.selection import checkpoint_problems
from megatron.config import ConfigError, load_config
from tests.conftest import read_metrics
from tests.distributed import run_on_ranks
from tests.test_tensor_parallel_training import TINY, train

pytestmark = pytest.mark.slow


def train_keeping_handlers(overrides: list[str]) -> bool:
    """Train; whether SIGTERM's handler is the one from before the run (a finished run must not catch it)."""
    before = signal.getsignal(signal.SIGTERM)
    train(overrides)
    return signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("condition, stopped_at, reason", [
    ("exit_interval=3", 3, "exit_interval=3 reached"),
    ("exit_duration_in_mins=0.0001", 1, "exit_duration_in_mins=0.0001 reached"),
])
def test_run_stops_early_with_a_checkpoint(condition, stopped_at, reason, demo_data, tmp_path, capfd):
    handlers_restored = run_on_ranks(2, train_keeping_handlers, [
        f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json", "train_iters=10",
        "eval_iters=1", "eval_interval=1000", f"save={tmp_path}/checkpoints", f"log_dir={tmp_path}/logs", condition])
    assert handlers_restored == [True, True]
    assert f"exiting after iteration {stopped_at}: {reason}" in capfd.readouterr().out
    records = read_metrics(tmp_path / "logs")
    assert [r["iteration"] for r in records] == list(range(1, stopped_at + 1))
    assert all(r["split"] == "train" for r in records), "a preempted run exits without the final evaluation"
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text() == f"global_step{stopped_at}"
    assert checkpoint_problems(checkpoints / f"global_step{stopped_at}") == []


def test_exit_signals_must_be_catchable():
    with pytest.raises(ConfigError, match=r"exit_signals \['SIGKILL'\] cannot be handled; choose among SIGTERM"):
        load_config([TINY], ["exit_signals=[SIGKILL]"])

"""metrics.jsonl, TensorBoard events and an offline wandb run from MetricsWriter."""

import json

from megatron.config import Config
from megatron.training.metrics import MetricsWriter
from tests.test_config import MINIMAL

RECORDS = [
    {"iteration": 1, "split": "train", "lm_loss": 7.5, "lr": 1e-3, "grad_norm": 1.25, "tokens_per_sec": 100.0},
    {"iteration": 2, "split": "valid", "lm_loss": 7.0},
]


def test_jsonl_and_tensorboard(tmp_path):
    cfg = Config.from_dict({**MINIMAL, "log_dir": str(tmp_path / "logs"), "tensorboard_dir": str(tmp_path / "tb")})
    writer = MetricsWriter(cfg, rank=0)
    for record in RECORDS:
        writer.write(record)
    writer.close()
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == RECORDS

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [run] = (tmp_path / "tb").iterdir()  # a folder per run
    assert run == writer.tensorboard_run
    events = EventAccumulator(str(run))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/lm_loss")] == [(1, 7.5)]
    assert [(e.step, e.value) for e in events.Scalars("valid/lm_loss")] == [(2, 7.0)]


def test_only_rank_zero_writes(tmp_path):
    cfg = Config.from_dict({**MINIMAL, "log_dir": str(tmp_path / "logs")})
    writer = MetricsWriter(cfg, rank=1)
    writer.write(RECORDS[0])
    writer.close()
    assert not (tmp_path / "logs").exists()


def test_wandb_offline_needs_no_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = Config.from_dict({**MINIMAL, "log_dir": str(tmp_path / "logs"), "use_wandb": True})
    writer = MetricsWriter(cfg, rank=0)
    for record in RECORDS:
        writer.write(record)
    writer.close()
    runs = list((tmp_path / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_a_resume_after_a_kill_mid_record_drops_the_cut_record_and_joins_nothing_to_it(tmp_path, capsys):
    """A SIGKILL while a record is written leaves part of it; the resumed run drops that part rather than append
    its first record onto it, which would leave neither JSON (and tools/plot_metrics.py refusing the run)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    whole = json.dumps(RECORDS[0]) + "\n"
    (logs / "metrics.jsonl").write_text(whole + json.dumps(RECORDS[1])[:17])
    writer = MetricsWriter(Config.from_dict({**MINIMAL, "log_dir": str(logs)}), rank=0)
    writer.write(RECORDS[1])
    writer.close()
    assert (logs / "metrics.jsonl").read_text() == whole + json.dumps(RECORDS[1]) + "\n"
    assert capsys.readouterr().out == (f"{logs / 'metrics.jsonl'}: dropped 17 bytes of records cut short when the "
                                       "run that wrote them was killed\n")


def train_record(iteration: int, loss: float) -> dict:
    return {"iteration": iteration, "split": "train", "lm_loss": loss}


def write_lines(path, records: list[dict], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records) + tail)


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path):
    """Only a record cut short is dropped: one that is whole JSON lacks nothing but the newline."""
    path = tmp_path / "logs" / "metrics.jsonl"
    write_lines(path, [RECORDS[0]], tail=json.dumps(RECORDS[1]))
    writer = MetricsWriter(Config.from_dict({**MINIMAL, "log_dir": str(path.parent)}), rank=0)
    writer.write(train_record(3, 6.5))
    writer.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [*RECORDS, train_record(3, 6.5)]


def test_a_resumed_run_logs_each_iteration_once_the_latest_attempts(tmp_path, capsys):
    """An attempt logged iterations 1-4 and was killed; the run resumes its checkpoint of iteration 2: iterations
    3 and 4 are logged again, so the earlier attempt's are dropped, and the file reads as one run."""
    path = tmp_path / "logs" / "metrics.jsonl"
    first = [train_record(iteration, 8.0 - iteration) for iteration in (1, 2, 3, 4)]
    write_lines(path, [*first[:2], {"iteration": 2, "split": "valid", "lm_loss": 6.1}, *first[2:]], tail='{"iter')
    writer = MetricsWriter(Config.from_dict({**MINIMAL, "log_dir": str(path.parent)}), rank=0, resumed_at=2)
    again = [train_record(3, 5.5), train_record(4, 5.0)]
    for record in again:
        writer.write(record)
    writer.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [*first[:2], {"iteration": 2, "split": "valid", "lm_loss": 6.1}, *again]
    assert capsys.readouterr().out == (
        f"{path}: dropped 2 records of iterations after 2, where this run starts: an earlier attempt logged "
        "them, and this run logs them again; dropped 6 bytes of records cut short when the run that wrote them was "
        "killed\n")
    assert not list(path.parent.glob("*.partial"))  # rewritten through a temporary file, renamed over it


def test_a_run_restarted_before_its_first_checkpoint_logs_each_iteration_once(tmp_path):
    """An attempt killed before its first save leaves iterations 1-3; the next starts afresh (iteration 0): they are
    logged again, so the earlier ones go; an evaluation at iteration 0 (the progressive driver's score) stays."""
    path = tmp_path / "logs" / "metrics.jsonl"
    score = {"iteration": 0, "split": "valid", "lm_loss": 7.0}
    write_lines(path, [score, *(train_record(iteration, 8.0 - iteration) for iteration in (1, 2, 3))])
    writer = MetricsWriter(Config.from_dict({**MINIMAL, "log_dir": str(path.parent)}), rank=0, resumed_at=0)
    writer.write(train_record(1, 7.5))
    writer.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [score, train_record(1, 7.5)]


def test_an_eval_only_run_sharing_a_live_runs_log_dir_only_appends_whole_lines(tmp_path):
    """The live run's file is not the evaluation's to rewrite: its records, and a line it is writing, stay; the
    evaluation's record starts a line of its own."""
    path = tmp_path / "logs" / "metrics.jsonl"
    in_flight = json.dumps(train_record(5, 4.0))[:20]
    write_lines(path, [train_record(iteration, 5.0) for iteration in (3, 4)], tail=in_flight)
    cfg = Config.from_dict({**MINIMAL, "log_dir": str(path.parent), "eval_only": True})
    writer = MetricsWriter(cfg, rank=0)
    writer.write(RECORDS[1])
    writer.close()
    lines = path.read_text().split("\n")
    assert lines[2] == in_flight and json.loads(lines[3]) == RECORDS[1] and lines[4] == ""
    assert [json.loads(line) for line in lines[:2]] == [train_record(3, 5.0), train_record(4, 5.0)]

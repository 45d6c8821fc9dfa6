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
    assert capsys.readouterr().out == (f"{logs / 'metrics.jsonl'}: dropped its last 17 bytes, a record cut short "
                                       "when the run that wrote it was killed\n")

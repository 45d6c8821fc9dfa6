"""tools/plot_metrics.py draws runs' metrics.jsonl into one PNG."""

from __future__ import annotations

import json
import math

import pytest

from tools import plot_metrics


def write_run(directory, scale: float) -> None:
    directory.mkdir(parents=True)
    records = []
    for step in range(1, 41):
        records.append({"iteration": step, "split": "train", "lm_loss": scale * (8 - math.log(step)),
                        "lr": 1e-3 * step / 40, "tokens_per_sec": 1000.0 + step})
        if step % 10 == 0:
            records.append({"iteration": step, "split": "valid", "lm_loss": scale * (8.2 - math.log(step))})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_two_runs_are_drawn_in_one_png_one_colour_each(tmp_path, capsys):
    write_run(tmp_path / "a" / "logs", 1.0)
    write_run(tmp_path / "b" / "logs", 0.9)
    out = plot_metrics.main([str(tmp_path / "a" / "logs"), str(tmp_path / "b" / "logs" / "metrics.jsonl"),
                             "--out", str(tmp_path / "m.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"wrote {out}: {tmp_path / 'a'}, {tmp_path / 'b'}" in capsys.readouterr().out
    figure = plot_metrics.plot({"a": plot_metrics.read_run(tmp_path / "a" / "logs"),
                                "b": plot_metrics.read_run(tmp_path / "b" / "logs")})
    loss, lr, throughput = figure.axes
    assert [line.get_label() for line in loss.lines] == ["a (train)", "a (valid)", "b (train)", "b (valid)"]
    assert len(loss.lines[1].get_xdata()) == 4 and loss.lines[0].get_color() != loss.lines[2].get_color()
    assert len(lr.lines) == 2 and len(throughput.lines) == 2


def test_a_missing_or_damaged_log_is_one_line(tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"iteration": 1}\nnot json\n')
    for argv, message in [([str(tmp_path / "none")], "holds no metrics.jsonl"),
                          ([str(tmp_path / "bad")], "metrics.jsonl line 2 is not JSON")]:
        with pytest.raises(SystemExit) as exit_:
            plot_metrics.main([*argv, "--out", str(tmp_path / "x.png")])
        error = capsys.readouterr().err
        assert exit_.value.code == 2 and message in error and error.count("\n") == 1


def test_a_log_ending_in_a_record_cut_short_is_drawn_without_it(tmp_path, capsys):
    """What a SIGKILL leaves (part of the last record, no newline) is left out, not a reason to refuse the run."""
    write_run(tmp_path / "a" / "logs", 1.0)
    with open(tmp_path / "a" / "logs" / "metrics.jsonl", "a") as log:
        log.write('{"iteration": 41, "split": "tra')
    records = plot_metrics.read_run(tmp_path / "a" / "logs")
    assert len(records) == 44 and records[-1]["iteration"] == 40
    out = plot_metrics.main([str(tmp_path / "a" / "logs"), "--out", str(tmp_path / "m.png")])
    assert out.is_file() and capsys.readouterr().err == ""

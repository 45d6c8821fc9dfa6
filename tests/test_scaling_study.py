"""The incremental-scaling study (benchmarks/incremental_scaling): its crossing arithmetic, its input checks,
and one tiny end-to-end run of the driver (train S, grow, train the grown L, train L from scratch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.incremental_scaling import run_study
from benchmarks.incremental_scaling.comparison import Comparison, compute_to_reach
from benchmarks.incremental_scaling.curves import Curve
from megatron.config import load_config
from megatron.model import TokenFormerArgs, flops_per_token
from megatron.tokenizer import build_tokenizer, pad_vocab_size
from tests.conftest import REPO

CONFIGS = REPO / "benchmarks" / "incremental_scaling" / "configs"


def curve(label: str, compute: list[float], loss: list[float]) -> Curve:
    return Curve(label, list(range(len(loss))), compute, loss)


def test_crossing_is_interpolated_linearly_between_evaluations():
    assert compute_to_reach(curve("b", [10.0, 20.0, 30.0], [5.0, 4.0, 2.0]), 3.0) == pytest.approx(25.0)
    assert compute_to_reach(curve("b", [10.0, 20.0], [5.0, 4.0]), 4.0) == 20.0


def test_curve_starting_below_the_target_crosses_at_its_first_point_and_one_above_never_does():
    assert compute_to_reach(curve("b", [7.0, 9.0], [3.0, 2.0]), 3.5) == 7.0
    assert compute_to_reach(curve("b", [7.0, 9.0], [5.0, 4.0]), 3.5) is None


def test_table_reports_the_fraction_of_c_compute_or_the_gap():
    small = curve("(a)", [1.0, 2.0], [6.0, 5.0])
    large = curve("(c)", [4.0, 8.0], [5.5, 4.0])
    reaching, short = curve("(b)", [2.0, 4.0, 6.0], [5.0, 4.5, 3.5]), curve("(b')", [2.0, 4.0], [5.5, 4.25])
    comparison = Comparison(small, reaching, short, large)
    assert comparison.fraction(reaching) == pytest.approx(5.0 / 8.0) and comparison.fraction(short) is None
    assert comparison.ratio_line() == ("compute ratio (grown run to reach (c)'s final loss 4.0000 / (c)): (b) "
                                       "preserve 0.625, (b') official not reached (+0.2500 above after 0.500 of "
                                       "(c)'s compute)")
    table = comparison.table()
    assert "| (b) | 3.5000 | 0.00 TFLOP |" in table and "not reached (ends +0.2500 above)" in table
    assert (comparison.growth_jump(reaching), comparison.growth_jump(short)) == (0.0, 0.5)
    assert "Growth check, (b'): S's last validation loss 5.000000, the grown model's before training 5.500000" in table


def test_missing_corpus_is_one_error_before_any_run(tmp_path, capsys):
    code = run_study.main(["--work-dir", str(tmp_path / "w"), "--data-path", str(tmp_path / "nothing_here")])
    error = capsys.readouterr().err
    assert code == 2 and "nothing_here" in error and error.count("error:") == 1
    assert not (tmp_path / "w" / "results").exists() and not (tmp_path / "w" / "checkpoints").exists()


def test_grown_schedule_must_end_on_an_evaluation(demo_data, tmp_path, capsys):
    code = run_study.main(["--work-dir", str(tmp_path / "w"), "--grown-iters", "15", "--eval-interval", "10",
                           "--data-path", str(demo_data / "demo_text_document"),
                           "--vocab-file", str(demo_data / "tokenizer.json")])
    assert code == 2 and "multiple of eval_interval 10" in capsys.readouterr().err


def flops_per_step(demo_data: Path, size: str) -> float:
    files = [CONFIGS / "common.yml", CONFIGS / f"{size}.yml"]
    cfg = load_config(files, world_size=load_config(files).num_gpus)
    vocab = build_tokenizer(cfg.tokenizer_type, str(demo_data / "tokenizer.json"), None).vocab_size
    args = TokenFormerArgs.from_config(cfg, padded_vocab_size=pad_vocab_size(vocab, cfg.make_vocab_size_divisible_by,
                                                                             cfg.model_parallel_size))
    return flops_per_token(args, include_recompute=False) * cfg.train_batch_size * cfg.seq_length


@pytest.mark.slow
def test_study_end_to_end_writes_table_plot_and_curves_on_the_shared_flops(demo_data, tmp_path):
    work = tmp_path / "study"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.incremental_scaling.run_study", "--work-dir", str(work),
         "--data-path", str(demo_data / "demo_text_document"), "--vocab-file", str(demo_data / "tokenizer.json"),
         "--train-iters", "4", "--grown-iters", "2", "--eval-interval", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("compute ratio (grown run to reach")

    results = work / "results"
    table = (results / "table.md").read_text()
    assert all(label in table for label in ("(a) S from scratch", "(b) S grown to L, preserve",
                                            "(b') S grown to L, official", "(c) L from scratch"))
    assert last_line in table
    assert (results / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    curves = json.loads((results / "curves.json").read_text())
    small_step, large_step = flops_per_step(demo_data, "small"), flops_per_step(demo_data, "large")
    small, grown, official, large = curves["small"], curves["grown"], curves["official"], curves["large"]
    assert small["iterations"] == large["iterations"] == [2, 4]
    assert grown["iterations"] == official["iterations"] == [0, 2]
    assert small["compute"] == pytest.approx([2 * small_step, 4 * small_step])
    assert large["compute"] == pytest.approx([2 * large_step, 4 * large_step])
    # (b) starts at S's total compute, with S's last validation loss (growth keeps the function), then adds L's.
    assert grown["compute"] == official["compute"] == pytest.approx([4 * small_step, 4 * small_step + 2 * large_step])
    assert grown["loss"][0] == pytest.approx(small["loss"][-1], abs=1e-4)
    assert abs(official["loss"][0] - small["loss"][-1]) > 1e-3  # official growth changes the function

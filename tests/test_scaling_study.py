"""The progressive-scaling study (benchmarks/incremental_scaling): its crossing arithmetic, its runs' plans and input
checks, and one tiny end-to-end run through the driver (a two-stage path in each growth mode, the last stage from
scratch, the first trained longer)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from benchmarks.incremental_scaling import run_study
from benchmarks.incremental_scaling.comparison import Comparison, compute_to_reach
from benchmarks.incremental_scaling.curves import Curve
from benchmarks.incremental_scaling.runs import SCRATCH_ITERS, write_runs
from megatron.config import ConfigError
from megatron.progressive.costs import stage_cost
from tests.conftest import REPO

TINY = REPO / "tests" / "tiny.yml"


def curve(label: str, compute: list[float], loss: list[float]) -> Curve:
    return Curve(label, list(range(len(loss))), compute, loss)


def test_crossing_is_interpolated_linearly_between_evaluations():
    assert compute_to_reach(curve("b", [10.0, 20.0, 30.0], [5.0, 4.0, 2.0]), 3.0) == pytest.approx(25.0)
    assert compute_to_reach(curve("b", [10.0, 20.0], [5.0, 4.0]), 4.0) == 20.0


def test_curve_starting_below_the_target_crosses_at_its_first_point_and_one_above_never_does():
    assert compute_to_reach(curve("b", [7.0, 9.0], [3.0, 2.0]), 3.5) == 7.0
    assert compute_to_reach(curve("b", [7.0, 9.0], [5.0, 4.0]), 3.5) is None


def test_table_reports_the_fraction_of_the_reference_compute_or_the_gap():
    reference = curve("L", [4.0, 8.0], [5.5, 4.0])
    reaching, short = curve("path", [2.0, 4.0, 6.0], [5.0, 4.5, 3.5]), curve("control", [2.0, 4.0], [5.5, 4.25])
    comparison = Comparison(reference, (reaching, short))
    assert comparison.fraction(reaching) == pytest.approx(5.0 / 8.0) and comparison.fraction(short) is None
    assert comparison.ratio_line() == ("compute ratio (to reach L's final loss 4.0000, over its compute): path 0.625, "
                                       "control not reached (+0.2500 above after 0.500 of its compute)")
    table = comparison.table()
    assert "| path | 3.5000 | 0.00 TFLOP |" in table and "not reached (ends +0.2500 above)" in table
    assert table.splitlines()[-1].startswith("| L | 4.0000 |")


def shared(directory, demo_data):
    path = directory / "study.yml"
    path.write_text(yaml.safe_dump({"data_path": f"{demo_data}/demo_text_document",
                                    "vocab_file": f"{demo_data}/tokenizer.json"}))
    return path


def test_the_study_runs_are_valid_plans_and_the_control_has_the_paths_compute(demo_data, tmp_path):
    runs = write_runs(tmp_path, shared(tmp_path, demo_data), scale=1.0)
    path, official, scratch, control = (runs[key].stages for key in ("progressive", "official", "scratch", "control"))
    assert [entry.slots for entry in path] == ["128/128/512", "256/256/1024", "512/512/2048"]
    assert [entry.growth is None for entry in path] == [True, False, False]
    assert [entry.config.growth_mode for entry in path] == ["preserve"] * 3
    assert [entry.config.growth_mode for entry in official] == ["preserve", "official", "official"]
    assert [entry.slots for entry in official] == [entry.slots for entry in path]
    assert runs["official"].plan.work_dir != runs["progressive"].plan.work_dir
    assert scratch[0].slots == "512/512/2048" and scratch[0].config.train_iters == SCRATCH_ITERS
    assert scratch[0].config.warmup == path[0].config.warmup  # S1's schedule and seed, S3's size
    assert control[0].slots == "128/128/512"
    step = stage_cost(control[0].config).flops_per_step
    assert abs(runs["control"].compute - runs["progressive"].compute) <= step / 2
    assert stage_cost(path[-1].config).pattention_share > 0.9  # Pattention dominates, as in the paper
    with pytest.raises(ConfigError, match="more than 90% of one epoch"):
        run_study.check_one_epoch(runs, demo_data / "demo_text_document")  # the demo corpus is too small


def test_missing_corpus_is_one_error_before_any_run(tmp_path, capsys):
    missing = tmp_path / "nothing_here"
    code = run_study.main(["--work-dir", str(tmp_path / "w"), "--data-path", str(missing), "--vocab-file",
                           str(tmp_path / "tokenizer.json")])
    error = capsys.readouterr().err
    assert code == 2 and "nothing_here" in error and error.count("error:") == 1
    assert not any((tmp_path / "w" / name).exists() for name in ("progressive", "scratch", "control", "results"))


@pytest.mark.slow
def test_study_end_to_end_writes_table_plot_and_curves_on_the_shared_flops(demo_data, tmp_path):
    extra = tmp_path / "extra.yml"
    extra.write_text(yaml.safe_dump({"lr_decay_iters": None, "eval_interval": 2}))
    plan = tmp_path / "plan.yml"
    plan.write_text(yaml.safe_dump({"configs": [str(TINY), str(extra)], "work_dir": "unused", "stages": [
        {"name": "s1", "train_iters": 4},
        {"name": "s2", "qkv_slot_num": 128, "proj_slot_num": 128, "ffn_slot_num": 512, "train_iters": 2}]}))
    work = tmp_path / "study"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.incremental_scaling.run_study", "--work-dir", str(work), "--plan", str(plan),
         "--scratch-iters", "6", "--data-path", str(demo_data / "demo_text_document"),
         "--vocab-file", str(demo_data / "tokenizer.json")],
        cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("compute ratio (to reach S2 from scratch's final loss")

    results = work / "results"
    table = (results / "table.md").read_text()
    assert all(label in table for label in (
        "| S1 |", "| S2 (grown from S1, preserve) |", "| S2 (grown from S1, official) |",
        "| S1 → S2 (progressive, preserve) |", "| S1 → S2 (progressive, official) |", "| S2 from scratch |",
        "| S1 trained longer |", "Prediction", "Growth modes at equal compute"))
    assert last_line in table and "(progressive, official)" in last_line
    assert (results / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "its first stage: a copy of" in result.stdout

    curves = json.loads((results / "curves.json").read_text())
    first, second = curves["paths"]["preserve"]["stages"]
    official_first, official_second = curves["paths"]["official"]["stages"]
    small = stage_cost(write_runs(tmp_path / "again", shared(tmp_path, demo_data), 1.0, plan)["progressive"]
                       .stages[0].config).flops_per_step
    assert first["iterations"] == [2, 4] and second["iterations"] == [0, 2]
    assert first["compute"] == pytest.approx([2 * small, 4 * small])
    # S2 starts at S1's total compute, with S1's last validation loss (growth keeps the function)
    assert second["compute"][0] == pytest.approx(4 * small) and second["loss"][0] == pytest.approx(first["loss"][-1])
    # the official path shares S1 (a copy: the same curve) and grows it differently: fresh keys change the function
    assert official_first["loss"] == first["loss"] and official_second["compute"] == second["compute"]
    assert official_second["loss"][0] != pytest.approx(first["loss"][-1], abs=1e-4)
    path = curves["paths"]["preserve"]["path"]
    assert curves["control"]["compute"][-1] == pytest.approx(path["compute"][-1], rel=0.5)
    assert curves["scratch"]["iterations"][-1] == 6

"""The growth study (benchmarks/incremental_scaling): its arithmetic, its verdict's sentences on made-up curves
(capacity-bound or not, a path reaching the target before its last growth), its runs' plans and input checks, and
one tiny end-to-end run through the driver (a two-stage path in each growth mode and without growth, the last stage
from scratch, the first trained longer, the dense Transformer)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import yaml

from benchmarks.incremental_scaling import run_study
from benchmarks.incremental_scaling.comparison import compute_to_reach, differences, loss_at, spread
from benchmarks.incremental_scaling.curves import Curve, joined
from benchmarks.incremental_scaling.report import (
    PathCurves,
    SeedCurves,
    path_sentences,
    reach,
    regime,
    verdict_line,
)
from benchmarks.incremental_scaling.runs import SCRATCH_ITERS, dense_shape, write_runs
from megatron.config import ConfigError
from megatron.progressive.costs import model_args, parameter_counts, stage_cost
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


def test_loss_at_a_compute_is_interpolated_and_refused_outside_the_curve():
    line = curve("c", [10.0, 20.0, 40.0], [5.0, 4.0, 3.0])
    assert loss_at(line, 15.0) == pytest.approx(4.5) and loss_at(line, 30.0) == pytest.approx(3.5)
    assert loss_at(line, 10.0) == 5.0 and loss_at(line, 40.0) == 3.0
    with pytest.raises(ValueError, match="outside its evaluations"):
        loss_at(line, 41.0)


def test_a_difference_exceeds_the_spread_only_beyond_two_standard_deviations_seed_by_seed():
    clear = differences([2.0, 2.1, 2.2], [1.0, 1.0, 1.1])
    assert clear.mean == pytest.approx(1.0667, abs=1e-4) and clear.exceeds_spread()
    noisy = differences([2.0, 1.0, 3.0], [1.9, 1.2, 2.6])
    assert noisy.exceeds_spread() is False
    assert spread([0.5]).exceeds_spread() is None and spread([0.5]).text() == "0.500"
    assert spread([1.0, 2.0]).text(2) == "1.50 ± 0.71"
    with pytest.raises(ValueError, match="seed by seed"):
        differences([1.0], [1.0, 2.0])


def made_up_seed(seed: int, shift: float, small_plateau: float, path_losses: list[float]) -> SeedCurves:
    """Reference 100 FLOPs ending at 2.0 + shift; the small model (control) flattens at small_plateau; the path's
    stages: S1 over 0-30, S2 over 30-60 (losses given: S1's three points, S2's three)."""
    s1 = curve("S1", [0.0, 15.0, 30.0], path_losses[:3])
    s2 = curve("S2 (grown from S1, preserve)", [30.0, 45.0, 60.0], path_losses[3:])
    restarted = curve("S2 (S1's size, restarted)", [30.0, 45.0, 60.0], [path_losses[2], small_plateau + 0.2,
                                                                          small_plateau + 0.1])
    paths = {key: PathCurves([s1, second], [], joined(label, [s1, second])) for key, label, second in (
        ("progressive", "S1 → S2 (preserve)", s2), ("official", "S1 → S2 (official)", s2),
        ("restarts", "S1 → S2 at S1's size (same restarts, no growth)", restarted))}
    singles = {"scratch": curve("S2 from scratch (reference)", [0.0, 50.0, 100.0], [4.0, 2.5 + shift, 2.0 + shift]),
               "control": curve("S1 trained longer", [0.0, 50.0, 100.0], [4.0, small_plateau + 0.05, small_plateau]),
               "dense": curve("dense", [0.0, 50.0, 100.0], [4.0, 2.7, 2.2])}
    return SeedCurves(seed, paths, singles, {})


def test_capacity_bound_regime_gives_a_verdict_and_says_where_each_path_got_there():
    seeds = [made_up_seed(n, shift, 2.6 + shift, [4.0, 3.0, 2.7, 2.7, 2.2, 1.9]) for n, shift in
             enumerate((0.0, 0.02, -0.01))]
    check = regime(seeds)
    assert check.capacity_bound and check.gap.mean == pytest.approx(0.6)
    reaches = {key: reach(seeds, key) for key in ("progressive", "official", "restarts", "control", "dense",
                                                  "scratch")}
    assert reaches["control"].reached is None and reaches["restarts"].count() == "0 of 3 seeds"
    sentence = path_sentences(seeds, "progressive", reaches)
    assert "reaches the reference's final loss in 3 of 3 seeds (S2 in 3)" in sentence
    assert "it saves" in sentence and "exceeds the spread" in sentence and "not the last growth" not in sentence
    line = verdict_line(check, reaches)
    assert line.startswith("verdict: capacity-bound") and "S1 trained longer not reached" in line


def test_a_path_reaching_the_target_before_its_last_growth_is_not_credited_to_growth():
    seeds = [made_up_seed(n, shift, 2.6, [4.0, 2.0, 1.8, 1.8, 1.7, 1.6]) for n, shift in enumerate((0.0, 0.01, 0.02))]
    reaches = {key: reach(seeds, key) for key in ("progressive", "restarts", "control")}
    sentence = path_sentences(seeds, "progressive", reaches)
    assert "(S1 in 3)" in sentence and "before S2, that is not the last growth's doing" in sentence


def test_no_verdict_when_the_large_model_does_not_end_clearly_below_the_small_one():
    seeds = [made_up_seed(n, shift, plateau, [4.0, 3.0, 2.7, 2.7, 2.2, 1.9]) for n, (shift, plateau) in
             enumerate(((0.0, 1.9), (0.1, 2.3), (-0.1, 2.0)))]  # the small model ends below, above, equal
    check = regime(seeds)
    assert not check.capacity_bound and "not capacity-bound: no verdict" in check.sentence("R", "S")
    reaches = {key: reach(seeds, key) for key in ("progressive", "scratch")}
    assert verdict_line(check, reaches).endswith(": no verdict")
    single = regime(seeds[:1])
    assert not single.capacity_bound and "one seed: no spread" in single.sentence("R", "S")


def shared(directory, demo_data):
    path = directory / "study.yml"
    path.write_text(yaml.safe_dump({"data_path": f"{demo_data}/demo_text_document",
                                    "vocab_file": f"{demo_data}/tokenizer.json"}))
    return path


def test_the_study_runs_are_valid_plans_with_their_controls(demo_data, tmp_path):
    runs = write_runs(tmp_path, shared(tmp_path, demo_data), scale=1.0, seed=7)
    path, official, restarts, scratch, control, dense = (runs[key].stages for key in (
        "progressive", "official", "restarts", "scratch", "control", "dense"))
    assert [entry.slots for entry in path] == ["16/16/64", "32/32/128", "64/64/256"]
    assert [entry.growth is None for entry in path] == [True, False, False]
    assert [entry.config.growth_mode for entry in path] == ["preserve"] * 3
    assert [entry.config.growth_mode for entry in official] == ["preserve", "official", "official"]
    assert [entry.slots for entry in official] == [entry.slots for entry in path]
    # without growth: the path's stages, lengths and restarts, every one at S1's size
    assert [entry.slots for entry in restarts] == ["16/16/64"] * 3
    assert [(e.config.train_iters, e.config.warmup) for e in restarts] == [(e.config.train_iters, e.config.warmup)
                                                                           for e in path]
    assert len({runs[key].plan.work_dir for key in runs}) == 6
    assert scratch[0].slots == "64/64/256" and scratch[0].config.train_iters == SCRATCH_ITERS
    assert scratch[0].config.warmup == path[0].config.warmup  # S1's schedule, S3's size
    assert control[0].slots == "16/16/64"
    step = stage_cost(control[0].config).flops_per_step
    longest = max(runs["progressive"].compute, runs["scratch"].compute)
    assert longest <= runs["control"].compute < longest + step  # covers the path's and the reference's compute
    assert dense[0].config.model_type == "transformer" and dense[0].config.train_iters == SCRATCH_ITERS
    large, baseline = stage_cost(scratch[0].config).parameters, stage_cost(dense[0].config).parameters
    assert abs(baseline - large) < 0.15 * large
    assert {entry.config.seed for run in runs.values() for entry in run.stages} == {7}
    with pytest.raises(ConfigError, match="more than 90% of one epoch"):
        run_study.check_one_epoch(runs, demo_data / "demo_text_document")  # the demo corpus is too small


def parameters(args) -> int:
    return parameter_counts(args)["total_params"]


def test_dense_shape_has_the_nearest_parameter_count_among_valid_widths(demo_data, tmp_path):
    large = write_runs(tmp_path, shared(tmp_path, demo_data), scale=1.0, seed=1)["scratch"].stages[0].config
    shape = dense_shape(large)
    args = model_args(large)

    def dense(width: int, heads: int) -> int:
        return parameters(dataclasses.replace(args, model_type="transformer", qkv_slot_num=None, proj_slot_num=None,
                                              ffn_slot_num=None, hidden_size=width, num_attention_heads=heads))

    target, chosen = parameters(args), dense(shape["hidden_size"], shape["num_attention_heads"])
    assert shape["hidden_size"] % shape["num_attention_heads"] == 0
    for width in (shape["hidden_size"] - 8, shape["hidden_size"] + 8):
        for heads in (1, 2, 4, 7, 8):
            if width % heads or not 16 <= width // heads <= 64 or (width // heads * 0.25) % 2:
                continue
            assert abs(dense(width, heads) - target) >= abs(chosen - target)


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
         "--scratch-iters", "6", "--seeds", "3", "--data-path", str(demo_data / "demo_text_document"),
         "--vocab-file", str(demo_data / "tokenizer.json")],
        cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("verdict: not capacity-bound") and last_line.endswith("no verdict")  # one seed

    results = work / "results"
    table = (results / "table.md").read_text()
    assert all(label in table for label in (
        "| S1 |", "| S2 (grown from S1, preserve) |", "| S2 (grown from S1, official) |",
        "| S2 (S1's size, restarted) |", "| S1 → S2 (preserve) |", "| S1 → S2 (official) |",
        "| S1 → S2 at S1's size (same restarts, no growth) |", "| S2 from scratch (reference) |",
        "| S1 trained longer |", "| dense Transformer of S2's size, from scratch |", "Prediction", "Regime check"))
    assert table.strip().splitlines()[-1] == last_line
    assert (results / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.stdout.count("its first stage: a copy of") == 2  # the official path and the one without growth

    curves = json.loads((results / "curves.json").read_text())["seeds"]["3"]
    first, second = curves["paths"]["progressive"]["stages"]
    official_first, official_second = curves["paths"]["official"]["stages"]
    small = stage_cost(write_runs(tmp_path / "again", shared(tmp_path, demo_data), 1.0, 3, plan)["progressive"]
                       .stages[0].config).flops_per_step
    assert first["iterations"] == [2, 4] and second["iterations"] == [0, 2]
    assert first["compute"] == pytest.approx([2 * small, 4 * small])
    # S2 starts at S1's total compute, with S1's last validation loss (growth keeps the function)
    assert second["compute"][0] == pytest.approx(4 * small) and second["loss"][0] == pytest.approx(first["loss"][-1])
    # the official path shares S1 (a copy: the same curve) and grows it differently: fresh keys change the function
    assert official_first["loss"] == first["loss"] and official_second["compute"] == second["compute"]
    assert official_second["loss"][0] != pytest.approx(first["loss"][-1], abs=1e-4)
    # without growth: S1's copy, then S1's model restarted, its compute counted at S1's size
    restarted = curves["paths"]["restarts"]["stages"][1]
    assert restarted["loss"][0] == pytest.approx(first["loss"][-1]) and restarted["compute"][-1] == pytest.approx(
        6 * small)
    reference = curves["scratch"]
    assert reference["iterations"][-1] == 6 and curves["dense"]["iterations"][-1] == 6
    assert curves["control"]["compute"][-1] >= max(curves["paths"]["progressive"]["path"]["compute"][-1],
                                                   reference["compute"][-1])

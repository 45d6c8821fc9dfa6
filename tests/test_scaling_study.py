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
from benchmarks.incremental_scaling.ablation import best_path, factor_sentences
from benchmarks.incremental_scaling.comparison import Reach, compute_to_reach, differences, loss_at, spread
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
    assert len({runs[key].plan.work_dir for key in runs}) == len(runs) == 11
    # the ablation: the path with one factor of a mode changed in every grown stage, S1 shared
    for key, expected in {"preserve_fresh_optimizer": ("preserve", None, "reset"),
                          "preserve_new_norm": ("preserve", "new", None),
                          "official_carried_optimizer": ("official", None, "carry"),
                          "official_old_norm": ("official", "old", None)}.items():
        stages = runs[key].stages
        assert stages[0].stage.settings == path[0].stage.settings and [e.slots for e in stages] == [
            e.slots for e in path]
        assert [(e.config.growth_mode, e.config.growth_norm_token_count, e.config.growth_optimizer)
                for e in stages[1:]] == [expected] * 2
    ramped = runs["preserve_norm_ramp"].stages
    assert [(e.config.growth_norm_token_count, e.config.norm_token_count_ramp_iters) for e in ramped] == [
        (None, 0), (None, 50), (None, 75)]  # a quarter of S2's 200 steps and of S3's 300
    quick = write_runs(tmp_path / "quick", shared(tmp_path, demo_data), scale=0.05, seed=7, quick=True)
    assert "restarts" not in quick and "dense" not in quick and len(quick["preserve_new_norm"].stages) == 2
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


def test_the_knowledge_task_is_prepared_as_the_first_task_is(tmp_path):
    """The second task's own parts, short of training (the quick run below trains the first task through the same
    code): its corpus built, its quick plans valid and within one epoch, and the report's corpus line."""
    args = run_study.parse_args(["--quick", "--task", "knowledge", "--work-dir", str(tmp_path)])
    studies, prefix = run_study.prepare(args, "knowledge")
    assert set(studies) == set(run_study.QUICK_SEEDS)
    assert {"progressive", "official", "scratch", "control"} <= set(studies[1])
    assert prefix.name == "knowledge_text_document"
    assert run_study.corpus_line(prefix).startswith(f"Corpus: {prefix}, synthetic knowledge")


@pytest.mark.slow
def test_quick_runs_the_whole_study_and_writes_its_table_plot_and_curves(tmp_path):
    """`--quick` on the first task (the check `make scaling-study STUDY_ARGS=--quick` makes on both): every growth
    path of the ablation through the driver, the reference and the control, and the report."""
    work = tmp_path / "study"
    result = subprocess.run([sys.executable, "-m", "benchmarks.incremental_scaling.run_study", "--quick",
                             "--task", "markov", "--work-dir", str(work)], cwd=REPO, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("markov: verdict: not capacity-bound")  # one seed
    assert result.stdout.count("its first stage: a copy of") == 6  # every other path shares S1
    ablation_labels = ("| S1 → S2 (preserve, optimizer reset) |", "| S1 → S2 (preserve, √n of the new count) |",
                       "| S1 → S2 (official, optimizer carried over) |", "| S1 → S2 (official, √n of the old count) |",
                       "| S1 → S2 (preserve, √n ramped to the new count over 25% of the stage) |")
    results = work / "markov" / "results"
    table = (results / "table.md").read_text()
    assert all(label in table for label in (
        "| S1 |", "| S2 (grown from S1, preserve) |", "| S2 (grown from S1, official) |",
        "| S2 from scratch (reference) |", "| S1 trained longer |", "Prediction", "Regime check", "## Ablation"))
    assert "restarted" not in table and "dense" not in table  # left out by --quick
    assert table.strip().splitlines()[-1] == last.split(": ", 1)[1]
    assert (results / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = json.loads((results / "curves.json").read_text())["seeds"]["1"]["paths"]
    first, second = curves["progressive"]["stages"]
    assert second["compute"][0] == pytest.approx(first["compute"][-1])
    assert all(label in table for label in ablation_labels) and "Ablation verdict: one seed" in table
    for key, keeps_function in (("progressive", True), ("preserve_fresh_optimizer", True),
                                ("preserve_norm_ramp", True), ("preserve_new_norm", False), ("official", False),
                                ("official_old_norm", False)):
        s1, s2 = curves[key]["stages"]
        assert s1["loss"] == first["loss"]  # the same S1 (a copy)
        assert (s2["loss"][0] == pytest.approx(s1["loss"][-1], rel=1e-5)) == keeps_function, key
    # official with the optimizer carried starts from official's grown model; only the updates differ
    assert curves["official_carried_optimizer"]["stages"][1]["loss"][0] == pytest.approx(
        curves["official"]["stages"][1]["loss"][0], rel=1e-6)
    assert curves["official_carried_optimizer"]["stages"][1]["loss"][-1] != curves["official"]["stages"][1][
        "loss"][-1]


def test_a_task_whose_ablation_did_not_run_says_so():
    """--quick runs the ablation on the first task only: the other tasks' reports say none of its paths ran."""
    finals = {"progressive": [1.80], "official": [1.58]}
    assert factor_sentences(finals)[-1] == ("Ablation verdict: none of the ablation's paths ran (--quick runs them on "
                                            "the first task only).")


def made_up_finals(new_norm: list[float], fresh_optimizer: list[float], official: list[float] | None = None):
    """Final losses of three seeds: preserve ~1.80, official ~1.58 (unless given), the ablation as given."""
    official = official or [1.580, 1.585, 1.575]
    return {"progressive": [1.800, 1.810, 1.790], "official": official, "preserve_new_norm": new_norm,
            "preserve_fresh_optimizer": fresh_optimizer, "official_carried_optimizer": [o + 0.001 for o in official]}


def test_the_ablation_names_the_factor_that_carries_officials_lead():
    norm_wins = factor_sentences(made_up_finals(new_norm=[1.60, 1.605, 1.59], fresh_optimizer=[1.80, 1.815, 1.79]))
    assert norm_wins[0] == "Official minus preserve: -0.2200 ± 0.0050 (exceeds the spread)."
    assert norm_wins[-1].startswith("Ablation verdict: the √n carries the difference: changed alone it moves "
                                    "preserve by -0.2017 ± 0.0029, 92% of official's lead")
    assert "also beyond" not in norm_wins[-1]
    optimizer_wins = factor_sentences(made_up_finals(new_norm=[1.79, 1.82, 1.80], fresh_optimizer=[1.62, 1.61, 1.60]))
    assert optimizer_wins[-1].startswith("Ablation verdict: the optimizer state carries the difference")
    assert any(line.startswith("The optimizer state (a fresh optimizer instead of the carried state): from preserve "
                               "-0.1900 ± 0.0100 (exceeds the spread); within official -0.0010")
               for line in optimizer_wins)
    both = factor_sentences(made_up_finals(new_norm=[1.70, 1.71, 1.69], fresh_optimizer=[1.65, 1.66, 1.64]))
    assert both[-1].startswith("Ablation verdict: the optimizer state carries the difference") and \
        "(the √n also beyond the spread)" in both[-1]
    neither = factor_sentences(made_up_finals(new_norm=[1.80, 1.70, 1.85], fresh_optimizer=[1.81, 1.79, 1.80]))
    assert neither[-1].startswith("Ablation verdict: no factor varied alone moves preserve toward official beyond "
                                  "the spread")
    level = factor_sentences(made_up_finals(new_norm=[1.79, 1.80, 1.80], fresh_optimizer=[1.80, 1.80, 1.80],
                                            official=[1.75, 1.85, 1.80]))
    assert level[-1] == ("Ablation verdict: official and preserve do not differ beyond the spread, so no factor "
                         "carries a difference.")
    assert factor_sentences({key: values[:1] for key, values in made_up_finals([1.6] * 3, [1.8] * 3).items()})[-1] \
        == "Ablation verdict: one seed, no spread to judge a factor by."


def test_a_factor_that_moves_preserve_away_from_official_carries_nothing_and_preserves_lead_is_named_as_its():
    """The verdict's sign guard: an effect beyond the spread but against the lead is no part of it; where preserve
    ends lower, the lead a factor carries is preserve's."""
    away = factor_sentences(made_up_finals(new_norm=[1.95, 1.96, 1.94], fresh_optimizer=[1.80, 1.815, 1.79]))
    assert "The √n (√n of the new token count instead of the old): from preserve 0.1500 ± 0.0000 (exceeds the " \
           "spread)" in " ".join(away)
    assert away[-1].startswith("Ablation verdict: no factor varied alone moves preserve toward official beyond "
                               "the spread (the optimizer state, the √n tried)")
    behind = factor_sentences(made_up_finals(new_norm=[1.99, 2.01, 1.98], fresh_optimizer=[1.80, 1.815, 1.79],
                                             official=[2.000, 2.015, 1.990]))
    assert behind[0] == "Official minus preserve: 0.2017 ± 0.0029 (exceeds the spread)."
    assert behind[-1] == ("Ablation verdict: the √n carries the difference: changed alone it moves preserve by "
                          "0.1933 ± 0.0058, 96% of preserve's lead of 0.2017 ± 0.0029.")


def reach_of(label: str, fractions: list, finals: list[float]) -> Reach:
    return Reach(label, fractions, spread(finals), 0.9)


def test_best_path_ranks_by_compute_where_every_seed_got_there_else_by_final_loss():
    first = reach_of("A", [0.50, 0.52, 0.48], [1.60, 1.61, 1.59])
    second = reach_of("B", [0.60, 0.61, 0.59], [1.58, 1.59, 1.57])
    sometimes = reach_of("C", [0.10, None, 0.12], [1.50, 1.70, 1.52])  # less compute, but not in every seed
    assert best_path({"b": second, "c": sometimes, "a": first}) == (
        "Least compute to reach the reference's final loss in every seed: A, at 0.500 ± 0.020 of the reference's "
        "compute; the next, B, needs 0.100 ± 0.010 more (exceeds the spread).")
    assert best_path({"a": first}) == ("Least compute to reach the reference's final loss in every seed: A, at "
                                       "0.500 ± 0.020 of the reference's compute.")
    never = reach_of("D", [None, None, None], [1.65, 1.70, 1.60])
    assert best_path({"d": never, "c": sometimes}) == (
        "No growth reaches the reference's final loss in every seed; the lowest final loss: C, 1.5733 ± 0.1102; the "
        "next, D, ends 0.0767 ± 0.0751 higher (within the spread).")

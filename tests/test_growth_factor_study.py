"""The growth-factor sweep (benchmarks/incremental_scaling/growth_factor.py): its paths are online plans that end
at the same model on the scratch run's compute, and its table and verdict say what the final losses say."""

from __future__ import annotations

import json

import pytest

from benchmarks.incremental_scaling import growth_factor
from benchmarks.incremental_scaling.growth_factor import PATHS, SCRATCH, report, write_runs
from tests.test_scaling_study import shared


def test_every_path_is_an_online_job_ending_at_the_final_model_on_the_scratch_runs_compute(demo_data, tmp_path):
    runs = write_runs(tmp_path, shared(tmp_path, demo_data), seed=5, scale=1.0)
    budget = runs[SCRATCH].compute
    assert [entry.slots for entry in runs[SCRATCH].stages] == ["64/64/256"]
    sizes = {key: [entry.slots for entry in runs[key].stages] for key in ("x2", "x4", "sqrt2x4")}
    assert sizes == {"x2": ["32/32/128", "64/64/256"], "x4": ["16/16/64", "64/64/256"],
                     "sqrt2x4": ["16/16/64", "23/23/91", "32/32/128", "45/45/181", "64/64/256"]}
    for path in PATHS:
        run = runs[path.key]
        assert run.plan.online and run.compute == pytest.approx(budget, rel=2e-3)  # within one step of S3
        assert sum(entry.steps for entry in run.stages[:-1]) == growth_factor.PRE_STEPS
        assert all(entry.config.seed == 5 for entry in run.stages)
        assert [entry.config.growth_mode for entry in run.stages[1:]] == ["official"] * path.growths
        assert run.stages[-1].config.lr_decay_iters == run.stages[-1].config.train_iters  # one schedule
    # a smaller start buys more steps of the final model
    assert runs["x4"].stages[-1].steps > runs["sqrt2x4"].stages[-1].steps > runs["x2"].stages[-1].steps


def write_losses(run, losses: list[float]) -> None:
    logs = run.plan.logs(run.plan.stages[-1])
    logs.mkdir(parents=True, exist_ok=True)
    records = [{"iteration": 50 * (index + 1), "split": "valid", "lm_loss": loss} for index, loss in enumerate(losses)]
    (logs / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))


@pytest.fixture
def two_seeds(demo_data, tmp_path):
    return {seed: write_runs(tmp_path / f"seed{seed}", shared(tmp_path, demo_data), seed=seed, scale=0.05)
            for seed in (1, 2)}


def test_the_table_and_verdict_follow_the_final_losses_seed_by_seed(two_seeds):
    finals = {1: {SCRATCH: 2.00, "x2": 1.90, "x4": 2.10, "sqrt2x4": 2.0040},
              2: {SCRATCH: 2.10, "x2": 2.01, "x4": 2.19, "sqrt2x4": 2.0960}}
    for seed, runs in two_seeds.items():
        for key, run in runs.items():
            write_losses(run, [3.0, finals[seed][key]])  # only the last evaluation counts
    lines = report(two_seeds)
    table = "\n".join(lines)
    assert "| ×2 once | 32/32/128 → 64/64/256 |" in table
    assert "| 1.9550 ± 0.0778 | -0.0950 ± 0.0071 (exceeds the spread) |" in table
    assert lines[-1] == ("verdict: against S3 from scratch on the same compute, ×2 once beats it by 0.0950; ×4 once "
                         "trails it by 0.0950; ×√2 four times ties it (within the spread); ×2 ends lower than ×4.")


def test_one_seed_says_it_has_no_spread(two_seeds):
    for key, run in two_seeds[1].items():
        write_losses(run, [2.0 if key == SCRATCH else 1.9])
    assert "(one seed: no spread)" in report({1: two_seeds[1]})[-1]

"""Which growth factor pays? One growth ×2, one growth ×4 and four growths ×√2, each grown inside one running
job (tools/progressive_scaling.py --online), against the final model trained from scratch on the same compute.

    .venv/bin/python -m benchmarks.incremental_scaling.growth_factor [--seeds 1 2 3] [--scale F] [--work-dir DIR]
        [--fresh]

The question of arXiv 2605.13405 ("When is warmstarting effective for scaling language models?", 2026), which
finds a 2× growth the most reliable and an upper bound on the factor beyond which training from scratch wins,
asked on the growth study's capacity-bound task (the order-2 Markov source: README.md). Every path ends at the
study's largest model (configs/plan.yml's last stage, S3: 64/64/256 parameter tokens) and trains on one warmup
and cosine over its whole length, reading the corpus in one stream, as an online job does:

- ×2 once: S3/2 for PRE_STEPS steps, then grown to S3;
- ×4 once: S3/4 for PRE_STEPS steps, then grown to S3;
- ×√2 four times: S3/4 grown by √2 every PRE_STEPS/4 steps (16 → 23 → 32 → 45 → 64 qkv tokens), S3 after
  PRE_STEPS;
- S3 from scratch: SCRATCH_ITERS steps.

Every path's compute equals the scratch run's (megatron/model/flops.py): what a smaller start saves buys steps of
S3 at the end. Growth mode official (the released recipe; the study's ablation found its √n of the new count is
what carries growth). A path is better than scratch where its final validation loss is lower, seed by seed, by
more than twice the differences' standard deviation. The table and a one-sentence verdict go to
WORK_DIR/results/growth_factor.md and stdout.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path


from benchmarks.incremental_scaling.comparison import Spread, differences, spread
from benchmarks.incremental_scaling.curves import validation_points
from benchmarks.incremental_scaling.run_study import check_one_epoch, corpus, corpus_line, write_shared
from benchmarks.incremental_scaling.runs import SEEDS, TEMPLATE, Run, scaled, write_plan
from megatron.config import ConfigError
from megatron.model.spec import slot_keys
from megatron.progressive.commands import REPO
from megatron.progressive.costs import stage_cost
from megatron.progressive.local import run_plan
from megatron.progressive.plan import read_plan
from megatron.progressive.processes import Interrupted, StepFailed
from megatron.progressive.stage_config import resolve_plan

PRE_STEPS = 300  # steps before the model reaches S3, in every growth path
SCRATCH_ITERS = 750
GROWTH_MODE = "official"


@dataclass(frozen=True)
class GrowthPath:
    """A growth path: start at the final counts / `factor`, reached in `growths` equal steps."""

    key: str
    label: str
    factor: float
    growths: int

    def counts(self, final: dict[str, int]) -> list[dict[str, int]]:
        """Every size on the path, the final one last; each growth multiplies each count by factor^(1/growths)."""
        ratio = self.factor ** (1 / self.growths)
        return [{key: round(final[key] / self.factor * ratio ** step) for key in final}
                for step in range(self.growths + 1)]


PATHS = (GrowthPath("x2", "×2 once", 2, 1), GrowthPath("x4", "×4 once", 4, 1),
         GrowthPath("sqrt2x4", "×√2 four times", 4, 4))
SCRATCH = "scratch"


def final_counts(template: Path) -> dict[str, int]:
    last = read_plan(template).stages[-1].settings
    return {key: last[key] for key in slot_keys()}


def _stage_compute(run: Run, index: int) -> float:
    entry = run.stages[index]
    return stage_cost(entry.config, entry.steps).training_flops


def path_stages(path: GrowthPath, final: dict[str, int], pre_steps: int, final_steps: int, seed: int) -> list[dict]:
    """An online plan's stages: each size for pre_steps / growths steps, the last for `final_steps`."""
    sizes, stages, end = path.counts(final), [], 0
    for index, counts in enumerate(sizes):
        end += final_steps if index == len(sizes) - 1 else pre_steps // path.growths
        stage = {"name": f"n{index}", **counts, "train_iters": end}
        stages.append({**stage, "seed": seed} if index == 0 else {**stage, "growth_mode": GROWTH_MODE})
    return stages


def write_runs(work_dir: Path, shared: Path, seed: int, scale: float, template: Path = TEMPLATE) -> dict[str, Run]:
    """One seed's runs, planned under work_dir/plans/ and resolved; every growth path's last stage as long as
    makes its compute the scratch run's. PlanError for anything the driver would refuse."""
    configs, final = [*read_plan(template).configs, shared], final_counts(template)
    plans = work_dir / "plans"
    scratch_path = write_plan(plans / f"{SCRATCH}.yml", configs, work_dir / SCRATCH,
                          [{"name": "s3", **final, "seed": seed, "train_iters": scaled(SCRATCH_ITERS, scale)}])
    scratch = read_plan(scratch_path)
    runs = {SCRATCH: Run(SCRATCH, scratch, resolve_plan(scratch))}
    budget, pre_steps = runs[SCRATCH].compute, scaled(PRE_STEPS, scale)
    for path in PATHS:
        plan_file = plans / f"{path.key}.yml"
        # first with one final step, to price the sizes before it; then the final stage sized to the budget
        probe = path_stages(path, final, pre_steps, 1, seed)
        draft = read_plan(write_plan(plan_file, configs, work_dir / path.key, probe), online=True)
        draft_run = Run(path.key, draft, resolve_plan(draft))
        before = sum(_stage_compute(draft_run, index) for index in range(len(probe) - 1))
        final_step = _stage_compute(draft_run, len(probe) - 1)
        stages = path_stages(path, final, pre_steps, max(1, round((budget - before) / final_step)), seed)
        plan = read_plan(write_plan(plan_file, configs, work_dir / path.key, stages), online=True)
        runs[path.key] = Run(path.key, plan, resolve_plan(plan))
    return runs


def final_loss(run: Run) -> float:
    """The run's last validation loss (the driver evaluates at the end of every job)."""
    return validation_points(run.plan.logs(run.plan.stages[-1]) / "metrics.jsonl")[-1][1]


def _compared(difference: Spread) -> str:
    exceeds = difference.exceeds_spread()
    where = "one seed: no spread" if exceeds is None else ("exceeds the spread" if exceeds else "within the spread")
    return f"{difference.text(4)} ({where})"


def report(studies: dict[int, dict[str, Run]]) -> list[str]:
    """The table (mean ± standard deviation over the seeds; differences seed by seed) and the verdict line."""
    seeds = list(studies)
    first = studies[seeds[0]]
    losses = {key: [final_loss(studies[seed][key]) for seed in seeds] for key in first}
    budget = first[SCRATCH].compute
    parameters = stage_cost(first[SCRATCH].stages[0].config).parameters
    rows = ["| path | sizes (qkv/proj/ffn tokens) | steps | tokens (per final parameter) | compute / scratch's | "
            "final valid loss | minus scratch's |", "| --- | --- | --- | --- | --- | --- | --- |"]
    versus = {}
    for key, run in first.items():
        sizes = " → ".join(entry.slots for entry in run.stages)
        steps = " + ".join(str(entry.steps) for entry in run.stages)
        tokens = sum(stage_cost(entry.config, entry.steps).tokens_per_step * entry.steps for entry in run.stages)
        versus[key] = differences(losses[key], losses[SCRATCH])
        label = next((path.label for path in PATHS if path.key == key), "S3 from scratch")
        shown = "—" if key == SCRATCH else _compared(versus[key])
        rows.append(f"| {label} | {sizes} | {steps} | {tokens / 1e6:.2f}M ({tokens / parameters:.1f}) | "
                    f"{run.compute / budget:.3f} | {spread(losses[key]).text(4)} | {shown} |")
    x2_x4 = differences(losses["x2"], losses["x4"])
    small_steps = differences(losses["sqrt2x4"], losses["x4"])
    lines = [*rows, "", f"Seeds {', '.join(map(str, seeds))}; differences are taken seed by seed and exceed the "
             "spread when their mean is more than twice their standard deviation.",
             f"×2 once minus ×4 once: {_compared(x2_x4)}; ×√2 four times minus ×4 once (the same start, grown in "
             f"four steps): {_compared(small_steps)}.", verdict(versus, x2_x4)]
    return lines


def _against_scratch(label: str, difference: Spread) -> str:
    exceeds = difference.exceeds_spread()
    if exceeds is False:
        return f"{label} ties it (within the spread)"
    said = f"{label} {'beats' if difference.mean < 0 else 'trails'} it by {abs(difference.mean):.4f}"
    return said + (" (one seed: no spread)" if exceeds is None else "")


def verdict(versus: dict[str, Spread], x2_x4: Spread) -> str:
    """One sentence from the table: each path against scratch, then ×2 against ×4."""
    paths = "; ".join(_against_scratch(path.label, versus[path.key]) for path in PATHS)
    if x2_x4.exceeds_spread() is False:
        factor = "×2 and ×4 end within the spread of each other"
    else:
        factor = f"×{'2' if x2_x4.mean < 0 else '4'} ends lower than ×{'4' if x2_x4.mean < 0 else '2'}"
    return f"verdict: against S3 from scratch on the same compute, {paths}; {factor}."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="default: %(default)s")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every run's steps by this")
    parser.add_argument("--work-dir", type=Path, default=REPO / "work_dirs" / "growth_factor")
    parser.add_argument("--fresh", action="store_true", help="remove the work dir's earlier runs first")
    args = parser.parse_args(argv)
    args.work_dir = args.work_dir.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fresh:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    try:
        prefix, vocab = corpus(argparse.Namespace(), "markov")
        shared = write_shared(argparse.Namespace(quick=False), args.work_dir, prefix, vocab)
        studies = {seed: write_runs(args.work_dir / f"seed{seed}", shared, seed, args.scale) for seed in args.seeds}
        for runs in studies.values():
            check_one_epoch(runs, prefix)
        for seed, runs in studies.items():
            for key, run in runs.items():
                print(f"--- seed {seed}, {key}: {run.plan.path}", flush=True)
                run_plan(run.plan, run.stages, echo=False)
    except (ConfigError, OSError) as error:
        print(f"growth_factor.py: error: {error}", file=sys.stderr)
        return 2
    except StepFailed as error:
        print(f"growth_factor.py: {error}", file=sys.stderr)
        return 1
    except Interrupted as stop:
        print(f"growth_factor.py: {stop}", file=sys.stderr)
        return 128 + stop.number
    text = "\n".join([corpus_line(prefix), "", *report(studies)])
    results = args.work_dir / "results" / "growth_factor.md"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(text + "\n", encoding="utf-8")
    print(f"\n{text}\n\nresults: {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The study's outputs from its runs' files: curves.json, table.md and scaling.png.

table.md holds, in order: what the FLOPs formula predicted before anything ran, the set-up (sizes, tokens per
parameter), the regime check, the result table (mean ± standard deviation over the seeds), the growth checks, the
verdict's sentences, the Ablation section (ablation.py) and, last, the verdict line. Every sentence is computed from the numbers in the table: when
the regime check fails (the largest model from scratch does not end clearly below what the smallest reaches on
the same compute), there is no verdict on growth, only the numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.incremental_scaling.ablation import ablation_section
from benchmarks.incremental_scaling.comparison import Reach, Spread, compute_to_reach, differences, loss_at, spread
from benchmarks.incremental_scaling.curves import PathCurves, SeedCurves, joined, run_curves
from benchmarks.incremental_scaling.plot import plot_study
from benchmarks.incremental_scaling.runs import GROWN, PATHS, Run
from megatron.progressive.costs import StageCost, stage_cost

SINGLE_RUNS = {"scratch": "{last} from scratch (reference)", "control": "{first} trained longer",
               "dense": "dense Transformer of {last}'s size, from scratch"}


def names(run: Run) -> list[str]:
    return [entry.stage.name.upper() for entry in run.stages]


def path_curves(run: Run) -> PathCurves:
    stage_names, how = names(run), PATHS[run.key]
    if run.key == "restarts":
        labels = [stage_names[0], *(f"{name} ({stage_names[0]}'s size, restarted)" for name in stage_names[1:])]
        label = f"{' → '.join(stage_names)} at {stage_names[0]}'s size (same restarts, no growth)"
    else:
        labels = [stage_names[0], *(f"{name} (grown from {before}, {how})"
                                    for before, name in zip(stage_names, stage_names[1:]))]
        label = f"{' → '.join(stage_names)} ({how})"
    stages, configs = run_curves(run, labels)
    return PathCurves(stages, configs, joined(label, stages))


def seed_curves(seed: int, runs: dict[str, Run]) -> SeedCurves:
    path_names = names(runs["progressive"])
    singles, configs = {}, {}
    for key, template in SINGLE_RUNS.items():
        if key in runs:
            label = template.format(first=path_names[0], last=path_names[-1])
            (singles[key],), (configs[key],) = run_curves(runs[key], [label])
    return SeedCurves(seed, {key: path_curves(runs[key]) for key in PATHS if key in runs}, singles, configs)


def prediction(runs: dict[str, Run]) -> list[str]:
    """What megatron/model/flops.py says before anything runs."""
    stages = [stage_cost(entry.config) for entry in runs["progressive"].stages]
    stage_names = names(runs["progressive"])
    scratch = runs["scratch"].compute
    before_last = sum(cost.training_flops for cost in stages[:-1]) / scratch
    shares = ", ".join(f"{name} {cost.pattention_share:.0%}" for name, cost in zip(stage_names, stages))
    per_token = ", ".join(f"{name} {cost.flops_per_token / stages[-1].flops_per_token:.2f}"
                          for name, cost in zip(stage_names[:-1], stages[:-1]))
    lines = [f"Pattention's share of the forward FLOPs: {shares}. Training FLOPs per token relative to "
             f"{stage_names[-1]}: {per_token}.",
             "Planned compute as a fraction of the reference (the large model from scratch): " + ", ".join(
                 f"{name} {cost.training_flops / scratch:.3f}" for name, cost in zip(stage_names, stages))
             + f"; each growth path {runs['progressive'].compute / scratch:.3f} in all, "
             + ", ".join(f"{what} {runs[key].compute / scratch:.3f}" for key, what in (
                 ("restarts", "the path without growth"), ("control", "the control"),
                 ("dense", "the dense Transformer")) if key in runs) + "."]
    if before_last < 0.5:
        lines.append(f"So a path saves 50% or more only if {stage_names[-1]}, after growth, reaches the reference's "
                     f"final loss within {0.5 - before_last:.3f} of the reference's compute "
                     f"({(0.5 - before_last) / (stages[-1].training_flops / scratch):.0%} of its own stage).")
    else:
        lines.append(f"{' and '.join(stage_names[:-1])} alone cost {before_last:.3f} of it: this plan cannot save 50%.")
    return lines


def _setup_row(label: str, cost: StageCost, steps: int) -> str:
    tokens = steps * cost.tokens_per_step
    return (f"| {label} | {cost.parameters / 1e6:.3f}M ({cost.pattention_parameters / 1e6:.3f}M) | "
            f"{cost.pattention_share:.0%} | {cost.flops_per_token / 1e6:.2f}M | {steps} | {tokens:,} | "
            f"{tokens / cost.parameters:.1f} |")


def setup_table(first: SeedCurves) -> str:
    rows = ["| run | parameters (of which Pattention) | Pattention share of FLOPs | training FLOPs/token | steps | "
            "tokens | tokens/parameter |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for key, path in first.paths.items():
        shown = zip(path.stages, path.configs) if key == "progressive" else list(zip(path.stages, path.configs))[1:]
        rows += [_setup_row(curve.label, stage_cost(cfg), cfg.train_iters) for curve, cfg in shown]
    rows += [_setup_row(curve.label, stage_cost(first.single_configs[key]), first.single_configs[key].train_iters)
             for key, curve in first.singles.items()]
    return "\n".join([*rows, "", "Steps and tokens of each run itself (a grown stage's after growth); the same for "
                      "every seed."])


@dataclass(frozen=True)
class Regime:
    """The reference's final loss against the small model's loss on the reference's compute, seed by seed."""

    reference: Spread
    small: Spread
    gap: Spread

    @property
    def capacity_bound(self) -> bool:
        return self.gap.mean > 0 and bool(self.gap.exceeds_spread())

    def sentence(self, reference: str, small: str) -> str:
        verdict = ("capacity-bound: the gap exceeds the spread" if self.capacity_bound else
                   "not capacity-bound: no verdict" + (" (one seed: no spread to compare with)"
                                                        if self.gap.sd is None else ""))
        return (f"Regime check: {reference} ends at {self.reference.text(4)}; {small} on the same compute is at "
                f"{self.small.text(4)}; the small model's loss minus the reference's, seed by seed: "
                f"{self.gap.text(4)}: {verdict}.")


def regime(seeds: list[SeedCurves]) -> Regime:
    reference = [seed.reference.final_loss for seed in seeds]
    small = [loss_at(seed.singles["control"], seed.reference.total_compute) for seed in seeds]
    return Regime(spread(reference), spread(small), differences(small, reference))


def reach(seeds: list[SeedCurves], key: str) -> Reach:
    fractions = []
    for seed in seeds:
        reached = compute_to_reach(seed.curve(key), seed.reference.final_loss)
        fractions.append(None if reached is None else reached / seed.reference.total_compute)
    curves = [seed.curve(key) for seed in seeds]
    return Reach(curves[0].label, fractions, spread([curve.final_loss for curve in curves]),
                 curves[0].total_compute / seeds[0].reference.total_compute)


def result_table(reaches: dict[str, Reach]) -> str:
    rows = ["| run | final valid loss | training compute / reference's | reaches the reference's final loss | "
            "compute to reach it / reference's |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| {r.label} | {r.final.text(4)} | {r.compute:.3f} | {r.count()} | {r.text()} |"
             for r in reaches.values()]
    return "\n".join([*rows, "", "Mean ± standard deviation over the seeds; the reference's final loss is each "
                      "seed's own."])


def growth_checks(seeds: list[SeedCurves]) -> list[str]:
    lines = []
    for key in seeds[0].paths:
        for index in range(1, len(seeds[0].paths[key].stages)):
            jumps = [seed.paths[key].stages[index].loss[0] - seed.paths[key].stages[index - 1].final_loss
                     for seed in seeds]
            label = seeds[0].paths[key].stages[index].label
            lines.append(f"Growth check, {label}: the model scored before training minus the stage before's last "
                         f"loss, {spread(jumps).text(6)} (largest |difference| {max(map(abs, jumps)):.2e}).")
    return lines


def stage_reached(seed: SeedCurves, key: str) -> str | None:
    """The stage during which a path reaches its seed's target (its name), None if it never does."""
    reached = compute_to_reach(seed.paths[key].path, seed.reference.final_loss)
    if reached is None:
        return None
    return next(stage for stage in seed.paths[key].stages if reached <= stage.total_compute).label.split()[0]


def _difference_text(difference: Spread, what: str) -> str:
    judged = difference.exceeds_spread()
    judgement = "one seed: no spread" if judged is None else "exceeds the spread" if judged else "within the spread"
    return f"{what} {difference.text()} ({judgement})"


def path_sentences(seeds: list[SeedCurves], key: str, reaches: dict[str, Reach]) -> str:
    """What one growth path did, against the reference, the same path without growth and the small model."""
    own = reaches[key]
    if own.reached is None:
        text = f"{own.label} does not reach the reference's final loss in any seed"
    else:
        during = [stage_reached(seed, key) for seed in seeds]
        where = ", ".join(f"{name} in {during.count(name)}" for name in dict.fromkeys(d for d in during if d))
        text = (f"{own.label} reaches the reference's final loss in {own.count()} ({where}), at "
                f"{own.reached.text()} of the reference's compute; " + _difference_text(own.saving, "it saves"))
        last = seeds[0].paths[key].stages[-1].label.split()[0]
        if any(name and name != last for name in during):
            text += f" — where it gets there before {last}, that is not the last growth's doing"
    small = [loss_at(seed.singles["control"], seed.paths[key].path.total_compute) for seed in seeds]
    path_final = [seed.paths[key].path.final_loss for seed in seeds]
    text += (f". At its own compute it ends at {own.final.text(4)}, the small model trained as long at "
             f"{spread(small).text(4)}: " + _difference_text(differences(small, path_final), "lower by"))
    if "restarts" in seeds[0].paths:
        restarts = [seed.paths["restarts"].path.final_loss for seed in seeds]
        text += ("; the same stages without growth end at " + spread(restarts).text(4) + ": "
                 + _difference_text(differences(restarts, path_final), "lower by"))
    return text + "."


def dense_sentence(seeds: list[SeedCurves], reaches: dict[str, Reach]) -> str:
    dense, reference = reaches["dense"], reaches["scratch"]
    parameters = [stage_cost(seeds[0].single_configs[key]).parameters for key in ("dense", "scratch")]
    return (f"The paper's baseline, {dense.label} ({parameters[0] / 1e6:.3f}M parameters against "
            f"{parameters[1] / 1e6:.3f}M, {dense.compute:.3f} of the reference's compute), ends at "
            f"{dense.final.text(4)} against the reference's {reference.final.text(4)}: "
            + _difference_text(differences(dense.final.values, reference.final.values), "higher by")
            + f"; it reaches the reference's final loss in {dense.count()}"
            + ("" if dense.reached is None else f", at {dense.text()} of its compute") + ".")


def modes_sentence(reaches: dict[str, Reach]) -> str:
    preserve, official = reaches["progressive"], reaches["official"]
    return (f"Growth modes at equal compute, from the same first stage: preserve ends at {preserve.final.text(4)}, "
            f"official at {official.final.text(4)}: "
            + _difference_text(differences(official.final.values, preserve.final.values), "official minus preserve")
            + ".")


def verdict_line(regime_check: Regime, reaches: dict[str, Reach]) -> str:
    gap = f"the small model's loss minus the reference's, on the reference's compute: {regime_check.gap.text(4)}"
    if not regime_check.capacity_bound:
        return f"verdict: not capacity-bound ({gap}): no verdict"
    reference = reaches["scratch"].final.values
    parts = []
    for key, r in reaches.items():
        if key == "scratch":
            continue
        if None in r.fractions:  # not reached in every seed: how far above the reference it ended instead
            parts.append(f"{r.label} {r.text()}, " + _difference_text(
                differences(r.final.values, reference), f"ends at {r.compute:.3f} of the compute above it by"))
        else:
            parts.append(f"{r.label} {r.text()}, " + _difference_text(r.saving, "saving"))
    return (f"verdict: capacity-bound ({gap}); compute to reach the reference's final loss, over the reference's: "
            + "; ".join(parts))


def write_report(studies: dict[int, dict[str, Run]], results: Path, header: list[str]) -> str:
    """Write curves.json, table.md and scaling.png into `results`; returns the table text, whose last line is
    the verdict."""
    seeds = [seed_curves(seed, runs) for seed, runs in studies.items()]
    reaches = {key: reach(seeds, key) for key in ("progressive", "official", "restarts", "control", "dense",
                                                  "scratch") if key in seeds[0].paths or key in seeds[0].singles}
    ablation = {key: reach(seeds, key) for key in GROWN if key in seeds[0].paths}
    regime_check = regime(seeds)
    results.mkdir(parents=True, exist_ok=True)
    curves = {str(seed.seed): {"paths": {key: {"stages": [c.to_dict() for c in p.stages], "path": p.path.to_dict()}
                                         for key, p in seed.paths.items()},
                               **{key: curve.to_dict() for key, curve in seed.singles.items()}} for seed in seeds}
    summary = {"capacity_bound": regime_check.capacity_bound, "regime_gap": regime_check.gap.values,
               "reached": {key: r.fractions for key, r in {**reaches, **ablation}.items()},
               "final": {key: list(r.final.values) for key, r in {**reaches, **ablation}.items()}}
    (results / "curves.json").write_text(json.dumps({"seeds": curves, "summary": summary}, indent=1) + "\n",
                                         encoding="utf-8")
    plot_study(seeds, results / "scaling.png")
    first_runs = next(iter(studies.values()))
    sentences = [regime_check.sentence(seeds[0].reference.label, seeds[0].singles["control"].label)]
    if regime_check.capacity_bound:
        sentences += [path_sentences(seeds, key, reaches) for key in ("progressive", "official")]
        sentences += [dense_sentence(seeds, reaches)] if "dense" in reaches else []
        sentences += [modes_sentence(reaches)]
    text = "\n\n".join(["\n".join(header), "Prediction (megatron/model/flops.py, before the runs): "
                        + " ".join(prediction(first_runs)), setup_table(seeds[0]), result_table(reaches),
                        "\n".join(growth_checks(seeds)), *sentences,
                        ablation_section(ablation, regime_check.capacity_bound), verdict_line(regime_check, reaches)])
    (results / "table.md").write_text(text + "\n", encoding="utf-8")
    return text

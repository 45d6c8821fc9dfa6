"""The report's Ablation section: which of the factors by which the growth modes differ carries the
difference between them.

preserve and official differ in three things (docs/growth.md): the new keys (zero or from the init), the n of
Θ's √n (old or new) and Adam's state (carried or reset). The ablation's paths (runs.ABLATION) change one factor
of a mode at a time, from the same first stage, so each factor's effect is a seed-paired difference of final
losses: the variant minus the mode it was changed from, written "toward official" (preserve changed to official's
choice, or official minus official changed back). A factor **carries** the lead (official's, or preserve's where
preserve ends lower) when its effect has the lead's sign and exceeds the spread; where several do, the largest
is named, with its share of the lead. The new
keys are not varied alone: what the varied factors leave of the lead is theirs (or the factors' interaction).
Every sentence is computed from the table's numbers (factor_sentences takes the final losses alone, so a test can
feed it made-up ones).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from benchmarks.incremental_scaling.comparison import Reach, Spread, differences, spread
from benchmarks.incremental_scaling.runs import RAMP_SHARE

# factor -> (the change toward official, [(variant, base) pairs whose final-loss difference measures it, the
# first from preserve]). A pair's difference is variant − base with the variant on official's side of the factor.
FACTORS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "the optimizer state": ("a fresh optimizer instead of the carried state", [
        ("preserve_fresh_optimizer", "progressive"), ("official", "official_carried_optimizer")]),
    "the √n": ("√n of the new token count instead of the old", [
        ("preserve_new_norm", "progressive"), ("official", "official_old_norm")]),
}


def _judged(difference: Spread) -> str:
    verdict = difference.exceeds_spread()
    return "one seed: no spread" if verdict is None else "exceeds the spread" if verdict else "within the spread"


def _side(variant: str, base: str) -> str:
    return "from preserve" if base == "progressive" else "within official"


def factor_sentences(finals: Mapping[str, Sequence[float]]) -> list[str]:
    """The ablation's sentences from each path's final losses, seed by seed (keys: runs.GROWN's); the last
    names the factor that carries official's lead over preserve, or says that none does."""
    lead = differences(finals["official"], finals["progressive"])
    lines = [f"Official minus preserve: {lead.text(4)} ({_judged(lead)})."]
    effects: dict[str, Spread] = {}
    for factor, (change, pairs) in FACTORS.items():
        measured = [(variant, base, differences(finals[variant], finals[base])) for variant, base in pairs
                    if variant in finals and base in finals]
        if not measured:
            continue
        effects[factor] = measured[0][2]
        lines.append(f"{factor[0].upper()}{factor[1:]} ({change}): " + "; ".join(
            f"{_side(variant, base)} {effect.text(4)} ({_judged(effect)})" for variant, base, effect in measured)
            + ".")
    if effects:
        rest = spread([total - sum(effect.values[i] for effect in effects.values())
                       for i, total in enumerate(lead.values)])
        lines.append(f"What the factors varied alone leave of the lead, if their effects add (the new keys' share, "
                     f"or the factors' interaction): {rest.text(4)} ({_judged(rest)}).")
    if "preserve_norm_ramp" in finals:
        ramp = differences(finals["preserve_norm_ramp"], finals["progressive"])
        lines.append(f"The √n ramp (the function kept at the growth, the new count's √n after {RAMP_SHARE:.0%} of "
                     f"the stage) against preserve: {ramp.text(4)} ({_judged(ramp)})" + "".join(
                         f"; against {name}: {gap.text(4)} ({_judged(gap)})" for name, key in (
                             ("√n of the new count at once", "preserve_new_norm"), ("official", "official"))
                         if key in finals and (gap := differences(finals["preserve_norm_ramp"], finals[key])))
                     + ".")
    lines.append(_verdict(lead, effects))
    return lines


def _verdict(lead: Spread, effects: Mapping[str, Spread]) -> str:
    if not effects:
        return "Ablation verdict: none of the ablation's paths ran (--quick runs them on the first task only)."
    if lead.exceeds_spread() is None:
        return "Ablation verdict: one seed, no spread to judge a factor by."
    if not lead.exceeds_spread():
        return ("Ablation verdict: official and preserve do not differ beyond the spread, so no factor carries a "
                "difference.")
    carrying = {factor: effect for factor, effect in effects.items()
                if effect.exceeds_spread() and (effect.mean > 0) == (lead.mean > 0)}
    if not carrying:
        return ("Ablation verdict: no factor varied alone moves preserve toward official beyond the spread "
                f"({', '.join(effects)} tried); the lead lies in the new keys or in the factors together.")
    factor = max(carrying, key=lambda name: abs(carrying[name].mean))
    share = carrying[factor].mean / lead.mean
    others = [name for name in carrying if name != factor]
    leader = "official" if lead.mean < 0 else "preserve"  # the lead is official minus preserve: lower is better
    return (f"Ablation verdict: {factor} carries the difference: changed alone it moves preserve by "
            f"{carrying[factor].text(4)}, {share:.0%} of {leader}'s lead of {lead.text(4)}"
            + (f" ({' and '.join(others)} also beyond the spread)" if others else "") + ".")


def best_path(ablation: Mapping[str, Reach]) -> str:
    """The growth that reaches the reference's final loss with the least compute in every seed, else the one that
    ends lowest, against the runner-up seed by seed."""
    everywhere = {key: r for key, r in ablation.items() if None not in r.fractions}
    if everywhere:
        ranked = sorted(everywhere, key=lambda key: everywhere[key].reached.mean)
        best = ablation[ranked[0]]
        text = (f"Least compute to reach the reference's final loss in every seed: {best.label}, at "
                f"{best.reached.text()} of the reference's compute")
        if len(ranked) > 1:
            runner = ablation[ranked[1]]
            gap = differences(runner.fractions, best.fractions)
            text += f"; the next, {runner.label}, needs {gap.text()} more ({_judged(gap)})"
        return text + "."
    ranked = sorted(ablation, key=lambda key: ablation[key].final.mean)
    best = ablation[ranked[0]]
    text = f"No growth reaches the reference's final loss in every seed; the lowest final loss: {best.label}, " \
           f"{best.final.text(4)}"
    if len(ranked) > 1:
        runner = ablation[ranked[1]]
        gap = differences(runner.final.values, best.final.values)
        text += f"; the next, {runner.label}, ends {gap.text(4)} higher ({_judged(gap)})"
    return text + "."


def ablation_table(ablation: Mapping[str, Reach]) -> str:
    rows = ["| growth | final valid loss | reaches the reference's final loss | compute to reach it / reference's |",
            "| --- | --- | --- | --- |"]
    rows += [f"| {r.label} | {r.final.text(4)} | {r.count()} | {r.text()} |" for r in ablation.values()]
    return "\n".join(rows)


def ablation_section(ablation: Mapping[str, Reach], capacity_bound: bool) -> str:
    """'## Ablation', its table and sentences."""
    finals = {key: r.final.values for key, r in ablation.items()}
    caveat = [] if capacity_bound else ["(The regime check failed: the reference is not clearly below the small "
                                        "model, so reaching it says little.)"]
    return "\n\n".join(["## Ablation", "Each path is the progressive path with its growths made as named; all share "
                        "the first stage and the schedule. Mean ± standard deviation over the seeds; differences "
                        "are taken seed by seed.", ablation_table(ablation), *caveat,
                        " ".join(factor_sentences(finals)), best_path(ablation)])

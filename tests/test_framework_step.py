"""benchmarks/framework_step.py at toy size on this CPU: the plain loop, the plain loop with fp32 masters and
clipping (the fair peer), and deepy.py's step with the lean step on and off, each in a process of its own, train
the same model on the same batches to the same losses (the lean step and DeepSpeed's within fp32 rounding, the
peer within the rounding of its own loss and norm kernels, the plain loop, which does not clip, close); the
table, the breakdown by phase, the decision table, the JSON the GPU check reads, and the final ratio."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

VARIANTS = ["plain", "plain+masters", "framework", "framework-deepspeed"]
STEPS = 1 + 2 + 1  # warm-up, timed, profiled


def relative_gap(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


def test_the_variants_train_the_same_model_to_the_same_losses_and_are_tabled(tmp_path):
    out = tmp_path / "framework_step.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.framework_step", "--size", "toy", "--warmup", "1",
                           "--steps", "2", "--profile-steps", "1", "--variants", *VARIANTS, "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["size"] == "toy" and report["precision"] == "fp32" and report["micro_batch"] == 2
    variants = report["variants"]
    assert list(variants) == VARIANTS and report["not_measured"] == []
    assert len({v["parameters"] for v in variants.values()}) == 1  # one model, trained four ways

    losses = {name: figures["losses"] for name, figures in variants.items()}
    assert all(len(series) == STEPS for series in losses.values())
    first = [series[0] for series in losses.values()]
    assert max(first) - min(first) < 1e-6 * first[0]  # the same weights see the same batch
    assert len(set(losses["framework"])) == STEPS  # the model trains: every step's loss differs
    assert relative_gap(losses["framework-deepspeed"], losses["framework"]) < 1e-6
    assert relative_gap(losses["plain+masters"], losses["framework"]) < 1e-5
    assert relative_gap(losses["plain"], losses["framework"]) < 1e-2

    for name, figures in variants.items():
        assert figures["tokens_per_sec"] > 0 and figures["tokens_per_step"] == 2 * 64
        phases = figures["breakdown"]
        for phase in ("phase: forward", "phase: loss", "phase: backward", "phase: optimizer"):
            assert phases[phase]["ops"] > 0, (name, phase)
        assert phases["phase: data"]["ops"] > 0
    lean, deepspeed = variants["framework"]["breakdown"], variants["framework-deepspeed"]["breakdown"]
    copies = "phase: gradient copies and reductions"
    assert lean[copies]["ops"] < deepspeed[copies]["ops"] / 5  # no buckets
    assert lean["phase: loss readout"]["ops"] > 0 and deepspeed["phase: loss readout"]["syncs"] >= 1

    [decision] = report["decisions"]
    assert decision["lever"] == "lean_step" and (decision["on"], decision["off"]) == ("framework",
                                                                                    "framework-deepspeed")
    assert decision["winner"] in ("on", "off", "tie")
    lines = done.stdout.splitlines()
    assert any(line.startswith("  lean_step ") for line in lines)
    framework = variants["framework"]
    assert framework["ratio_to_plain+masters"] == pytest.approx(
        framework["tokens_per_sec"] / variants["plain+masters"]["tokens_per_sec"])
    assert lines[-1] == ("ratio: framework (deepy.py's step) tokens/s / plain+masters tokens/s = "
                         f"{framework['ratio_to_plain+masters']:.3f} (/ plain: {framework['ratio_to_plain']:.3f})")

"""benchmarks/framework_step.py at toy size on this CPU: the plain loop and the framework's step exactly as deepy.py
builds it (DeepSpeed's plain and pipeline engines, ZeRO-1) each in a process of its own, the table of tokens/s and
ratios, the breakdown by phase with its costliest operators, the JSON the GPU check reads, and the final ratio."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

VARIANTS = ["plain", "framework-pp0", "framework-pp1"]


def test_the_toy_benchmark_measures_and_breaks_down_every_variant(tmp_path):
    out = tmp_path / "framework_step.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.framework_step", "--size", "toy", "--warmup", "1",
                           "--steps", "2", "--profile-steps", "1", "--variants", *VARIANTS, "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["size"] == "toy" and report["precision"] == "fp32" and report["micro_batch"] == 2
    variants = report["variants"]
    assert list(variants) == VARIANTS
    parameters = {v["parameters"] for v in variants.values()}
    assert len(parameters) == 1  # one model, trained three ways
    for name, figures in variants.items():
        assert figures["tokens_per_sec"] > 0 and figures["tokens_per_step"] == 2 * 64
        phases = figures["breakdown"]
        for phase in ("phase: forward", "phase: loss", "phase: backward", "phase: optimizer"):
            assert phases[phase]["ops"] > 0, (name, phase)
        if name.startswith("framework"):
            assert phases["phase: data"]["ops"] > 0 and phases["phase: loss readout"]["syncs"] >= 1
            assert phases["phase: optimizer"]["operators"]  # named, with calls and times
    assert variants["plain"]["ratio_to_plain"] == 1.0
    lines = done.stdout.splitlines()
    assert any(line.startswith("framework-pp1 ") for line in lines)
    assert "costliest operators per step (host ms, calls), in the phases the plain loop keeps small" in lines
    ratio = variants["framework-pp1"]["tokens_per_sec"] / variants["plain"]["tokens_per_sec"]
    assert lines[-1] == ("ratio: framework (framework-pp1, configs/1-5B.yml's pipe_parallel_size) tokens/s / plain "
                         f"loop tokens/s = {ratio:.3f}")

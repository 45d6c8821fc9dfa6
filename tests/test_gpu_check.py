"""benchmarks/gpu_check.py, the one command for a borrowed GPU machine, run on this CPU so that its plumbing is known
to work before GPU time is spent on it: without CUDA it refuses in one line (exit 2); with --cpu-plumbing every step
runs at toy sizes, the GPU-only ones say "unavailable", deepy.py trains flash and fused, the framework sweep and
cluster_check.py's one-device sections run, and the JSON and markdown reports are written with the step list and
the targets; and the GPU tier's flash training check (tests/test_gpu.py) is built here to see that it sums over
several of flash's kernel tiles.

The framework sweep is benchmarks/framework_step.py at toy size, each variant in a process of its own: the plain
loop, the plain loop with fp32 masters and clipping (the fair peer), and deepy.py's step with the lean step on and
off train the same model on the same batches to the same losses (the lean step and DeepSpeed's within fp32
rounding, the peer within the rounding of its own loss and norm kernels, the plain loop, which does not clip,
close); its table, breakdown by phase, decision table, JSON and final ratio are checked here."""

import json
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu_check import (FRAMEWORK_VARIANTS, ONE_DEVICE_SECTIONS, STEPS, TARGETS, largest_config_rows,
                                  pytest_counts)
from benchmarks.max_micro_batch import largest_that_fits
from megatron.cluster_check.report import PASS
from tests.conftest import REPO


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the check would run for real")
def test_without_cuda_it_says_so_in_one_line_and_exits_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[-1].startswith("benchmarks.gpu_check: needs a CUDA device")
    assert not any(tmp_path.iterdir())


def test_pytest_counts_reads_the_closing_line():
    assert pytest_counts("....\n24 passed, 2 skipped in 30.1s\n") == {"passed": 24, "skipped": 2}
    assert pytest_counts("F\n1 failed, 3 passed, 1 error in 2s") == {"failed": 1, "passed": 3, "error": 1}
    assert pytest_counts("") == {}


@pytest.mark.parametrize("limit", [1, 7, 64])
@pytest.mark.parametrize("capacity", [0, 1, 5, 16, 17, 63, 64])
def test_the_micro_batch_search_finds_the_largest_that_fits(capacity, limit):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= capacity

    assert largest_that_fits(fits, limit) == min(capacity, limit)
    assert len(tried) <= 2 * limit.bit_length() + 1


def test_the_largest_config_rows_are_the_1_5B_shapes():
    rows = [{"name": "150M ffn"}, {"name": "1-5B qkv/proj"}, {"name": "1-5B ffn"}]
    assert largest_config_rows(rows) == rows[1:]


def relative_gap(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


def assert_one_model_trained_alike(sweep: dict, steps: int) -> None:
    """framework_step's JSON: the variants train one model on the same batches to the same losses, each step split
    by phase, the lean step without DeepSpeed's gradient buckets, and the lean_step lever decided."""
    variants = sweep["variants"]
    assert sweep["precision"] == "fp32" and sweep["micro_batch"] == 2 and sweep["not_measured"] == []
    assert len({v["parameters"] for v in variants.values()}) == 1  # one model, trained every way
    losses = {name: variants[name]["losses"] for name in ("plain", "plain+masters", "framework", "framework-deepspeed")}
    assert all(len(series) == steps for series in losses.values())
    first = [series[0] for series in losses.values()]
    assert max(first) - min(first) < 1e-6 * first[0]  # the same weights see the same batch
    assert len(set(losses["framework"])) == steps  # the model trains: every step's loss differs
    assert relative_gap(losses["framework-deepspeed"], losses["framework"]) < 1e-6
    assert relative_gap(losses["plain+masters"], losses["framework"]) < 1e-5
    assert relative_gap(losses["plain"], losses["framework"]) < 1e-2
    for name, figures in variants.items():
        ranks = 2 if name.endswith("-dp2") else 1  # each rank's tokens counted once
        assert figures["tokens_per_sec"] > 0 and figures["tokens_per_step"] == 2 * 64 * ranks
        phases = figures["breakdown"]
        for phase in ("phase: forward", "phase: loss", "phase: backward", "phase: optimizer", "phase: data"):
            assert phases[phase]["ops"] > 0, (name, phase)
    lean, deepspeed = variants["framework"]["breakdown"], variants["framework-deepspeed"]["breakdown"]
    copies = "phase: gradient copies and reductions"
    assert lean[copies]["ops"] < deepspeed[copies]["ops"] / 5  # no buckets
    assert lean["phase: loss readout"]["ops"] > 0 and deepspeed["phase: loss readout"]["syncs"] >= 1
    assert variants["framework-dp2"]["breakdown"][copies]["ops"] > 0  # the lean step's bucketed all-reduce
    assert variants["framework-dp2"]["reduction_seconds"] > 0
    lean_step = next(row for row in sweep["decisions"] if row["lever"] == "lean_step")
    assert (lean_step["on"], lean_step["off"]) == ("framework", "framework-deepspeed")
    assert lean_step["winner"] in ("on", "off", "tie")
    framework = variants["framework"]
    assert framework["ratio_to_plain+masters"] == pytest.approx(
        framework["tokens_per_sec"] / variants["plain+masters"]["tokens_per_sec"])
    lines = sweep["table"].splitlines()
    assert any(line.startswith("  lean_step ") for line in lines)
    assert lines[-1] == ("ratio: framework (deepy.py's step) tokens/s / plain+masters tokens/s = "
                         f"{framework['ratio_to_plain+masters']:.3f} (/ plain: {framework['ratio_to_plain']:.3f})")


@pytest.mark.slow
@pytest.mark.network
def test_cpu_plumbing_runs_every_step_and_writes_the_report(built_gpu_kit, tmp_path):
    """The kit (built from the package index) is installed into a temporary site folder; the rest as on a GPU."""
    kit = built_gpu_kit
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--cpu-plumbing", "--kit", str(kit),
                             "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    steps = {step["name"]: step for step in report["steps"]}
    assert list(steps) == list(STEPS)
    assert steps["kit"]["status"] == "ok" and len(steps["kit"]["details"]["wheels"]) >= 7
    assert steps["environment"]["details"]["deepspeed"] == "0.19.8"
    assert steps["environment"]["details"]["gemm_tflops"] > 0
    assert steps["gpu-tests"]["status"] == "unavailable" and steps["gpu-tests"]["details"]["counts"]["skipped"] > 0
    assert steps["kernels"]["status"] == steps["max-batch"]["status"] == "unavailable"
    training = steps["training"]
    assert training["status"] == "ok", training
    runs = training["details"]["runs"]
    assert set(runs) == {"flash", "fused"} and all(run["iterations"] == 8 for run in runs.values())
    for run in runs.values():
        assert run["tokens_per_sec"] > 0 and run["tflops_per_device"] > 0 and run["peak_memory_gib"] > 0.1
        assert run["mfu"] is None  # a CPU has no peak in the table
    assert training["details"]["fused_vs_flash_max_relative_loss_gap"] < 1e-4
    framework = steps["framework"]
    assert framework["status"] == "ok", framework
    figures = framework["details"]
    assert figures["size"] == "toy" and list(figures["variants"]) == list(FRAMEWORK_VARIANTS)
    assert figures["framework_over_plain_masters"] > 0
    assert report["targets"]["framework / plain+masters tokens/s"]["figure"] == figures["framework_over_plain_masters"]
    assert {row["lever"] for row in figures["decisions"]} == {"lean_step", "compile.enable"}
    assert_one_model_trained_alike(figures, steps=2 + 4 + 1)  # gpu_check's warm-up, timed and profiled steps
    assert report["targets"]["flash / fused training tokens/s (4 layers)"]["figure"] == (
        runs["flash"]["tokens_per_sec"] / runs["fused"]["tokens_per_sec"])
    assert set(report["targets"]) == set(TARGETS)
    assert report["targets"]["script wall time (s)"]["verdict"] == "met"
    cluster_check = steps["cluster-check"]
    assert cluster_check["status"] == "ok" and cluster_check["details"]["sections"] == dict.fromkeys(
        ONE_DEVICE_SECTIONS, PASS), cluster_check
    markdown = (out / "gpu_check.md").read_text()
    assert "| training | ok |" in markdown and "| target | rule | figure | verdict |" in markdown
    assert "| cluster-check | ok |" in markdown
    assert result.stdout.splitlines()[-1].startswith("target: script wall time (s) <= 480:")


def test_the_gpu_tiers_flash_training_check_runs_flashs_kernels_over_many_row_and_token_tiles():
    """tests/test_gpu.py's flash-vs-fused training runs only on CUDA: its model and batches are checked here, on the
    CPU, to run flash's Triton kernels (an l2 Θ) over several row tiles of the CUDA tiles and the FFN over several
    token tiles (one tile would compare no sum over tiles)."""
    from megatron.model.pattention.flash_triton import TILES
    from megatron.model.pattention.registry import FLASH_KERNEL_THETAS
    from tests.test_gpu import training_setup

    model, _, batches = training_setup("flash", "cpu", "kernels")
    mlp = model.layers[0].mlp
    assert mlp.impl == "flash" and mlp.flash_backend == "kernels" and mlp.theta in FLASH_KERNEL_THETAS
    assert batches.dtype == torch.int64
    assert batches[0, :, :-1].numel() >= 8 * TILES["default"].m and len(mlp.key_param_tokens) >= 8 * TILES["default"].n

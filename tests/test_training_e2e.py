"""End-to-end runs through `python deepy.py train.py ...`: real DeepSpeed, 2 processes on gloo.

One training run of 40 iterations feeds several checks (loss drop, metrics,
checkpoints, exact resume, eval_only), because each launch is costly on a CPU.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, read_metrics, run_deepy

pytestmark = pytest.mark.slow

TINY = str(REPO / "tests" / "tiny.yml")


def data_overrides(demo_data: Path) -> list[str]:
    return [f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json"]


@pytest.fixture(scope="module")
def baseline_run(demo_data, tmp_path_factory):
    """40 iterations, ZeRO-1, checkpoints at 10 and 40, pattention_impl auto (the default: fused at this size)."""
    run_dir = tmp_path_factory.mktemp("baseline")
    result = run_deepy(
        "train.py",
        TINY,
        *data_overrides(demo_data),
        f"save={run_dir}/checkpoints",
        f"log_dir={run_dir}/logs",
        "extra_save_iters=[10]",
        env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
    )
    return run_dir, result


def train_losses(log_dir: Path) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in read_metrics(log_dir) if r["split"] == "train"}


def test_zero1_run_lowers_loss_and_writes_outputs(baseline_run):
    run_dir, result = baseline_run
    losses = train_losses(run_dir / "logs")
    assert sorted(losses) == list(range(1, 41))
    assert losses[1] - losses[40] > 1.0, losses
    records = read_metrics(run_dir / "logs")
    train = [r for r in records if r["split"] == "train"]
    for key in ("lr", "grad_norm", "tokens_per_sec", "flops_per_sec", "tflops_per_device", "peak_memory_bytes"):
        assert all(r[key] is not None and r[key] > 0 for r in train), key
    # A CPU has no peak in the table: no MFU without peak_tflops; the peak resident set is at least 100 MiB
    assert all(r["mfu"] is None and r["peak_memory_bytes"] > 100 * 2**20 for r in train)
    assert "GFLOP/s/device" in result.stdout and "peak RSS" in result.stdout and "MFU" not in result.stdout
    assert [r["iteration"] for r in records if r["split"] == "valid"] == [20, 40]
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "global_step40"
    assert (checkpoints / "global_step10" / "mp_rank_00_model_states.pt").is_file()
    assert (checkpoints / "global_step40" / "config.json").is_file()
    assert "run summary" in result.stdout and "final valid loss" in result.stdout
    # The first interval is marked as including warm-up; elapsed time grows and the ETA runs down to zero
    assert [r["includes_warmup"] for r in train] == [True] + [False] * 39
    assert all(a["elapsed_s"] < b["elapsed_s"] for a, b in zip(train, train[1:]))
    assert train[-1]["eta_s"] == 0 and all(r["eta_s"] > 0 for r in train[:-1])
    assert result.stdout.count("(incl. warm-up)") == 1 and "| ETA 0:00:00" in result.stdout
    assert "| elapsed 0:00:" in result.stdout
    assert (result.stdout + result.stderr).count("Setting accelerator to CPU") <= 1  # deepy.py's own, at most
    cores = len(os.sched_getaffinity(0))
    said = f"threads: {max(1, cores // 2)} per process ({cores} cores, 2 processes per node)"
    assert result.stdout.count(said) == 1, result.stdout


def step_10_of(run_dir: Path, tmp_path: Path) -> Path:
    """A save directory holding only the baseline's global_step10, as `latest`."""
    resumed = tmp_path / "checkpoints"
    resumed.mkdir()
    shutil.copytree(run_dir / "checkpoints" / "global_step10", resumed / "global_step10")
    (resumed / "latest").write_text("global_step10")
    return resumed


def test_resume_from_iteration_10_is_bitwise_identical_even_scored_first(baseline_run, demo_data, tmp_path):
    """eval_at_start (how tools/progressive_scaling.py scores a grown stage in its training launch) adds a
    validation at the loaded iteration and changes nothing of the training."""
    run_dir, _ = baseline_run
    resumed = step_10_of(run_dir, tmp_path)
    result = run_deepy(
        "train.py",
        TINY,
        *data_overrides(demo_data),
        f"load={resumed}",
        f"save={resumed}",
        f"log_dir={tmp_path}/logs",
        "eval_at_start=true",
    )
    assert "resumed from" in result.stdout and "warning: resuming at iteration" not in result.stdout
    expected = train_losses(run_dir / "logs")
    got = train_losses(tmp_path / "logs")
    assert sorted(got) == list(range(11, 41))
    assert all(got[i] == expected[i] for i in got), [(i, got[i], expected[i]) for i in got if got[i] != expected[i]]
    valid = [(r["iteration"], r["lm_loss"]) for r in read_metrics(tmp_path / "logs") if r["split"] == "valid"]
    baseline = [(r["iteration"], r["lm_loss"]) for r in read_metrics(run_dir / "logs") if r["split"] == "valid"]
    assert [iteration for iteration, _ in valid] == [10, 20, 40] and valid[1:] == baseline
    assert "validation at iteration 10" in result.stdout


def test_a_resume_whose_schedule_jumps_the_learning_rate_says_which_keys_do_it(baseline_run, demo_data, tmp_path):
    run_dir, _ = baseline_run
    resumed = step_10_of(run_dir, tmp_path)
    result = run_deepy("train.py", TINY, *data_overrides(demo_data), f"load={resumed}", f"save={resumed}",
                       f"log_dir={tmp_path}/logs", "lr_decay_iters=12", "train_iters=12")
    warning = next(line for line in result.stdout.splitlines() if line.startswith("warning: resuming at"))
    assert warning.startswith("warning: resuming at iteration 10 with learning rate 8.014e-04, 5.") and (
        "x lower than the 4.526e-03 the checkpoint's run would have used next: lr_decay_iters (40 -> 12), "
        "train_iters (40 -> 12) differ from its config.json") in warning


def test_eval_only_scores_the_same_validation_samples(baseline_run, demo_data, tmp_path):
    run_dir, _ = baseline_run
    run_deepy(
        "train.py",
        TINY,
        *data_overrides(demo_data),
        f"load={run_dir}/checkpoints",
        "eval_only=true",
        f"log_dir={tmp_path}/logs",
    )
    (record,) = read_metrics(tmp_path / "logs")
    final_valid = [r for r in read_metrics(run_dir / "logs") if r["split"] == "valid"][-1]
    assert record["split"] == "valid" and record["iteration"] == 40
    assert record["lm_loss"] == pytest.approx(final_valid["lm_loss"], rel=1e-6)


def test_misspelled_key_fails_before_any_process_starts(demo_data):
    result = run_deepy("train.py", TINY, *data_overrides(demo_data), "hiden_size=64", check=False)
    assert result.returncode == 2
    assert "hiden_size" in result.stderr and "hidden_size" in result.stderr
    assert "Traceback" not in result.stderr


def test_impossible_batch_fails_with_the_rule(demo_data):
    result = run_deepy("train.py", TINY, *data_overrides(demo_data), "train_batch_size=10", check=False)
    assert result.returncode == 2
    assert "train_batch_size" in result.stderr and "Traceback" not in result.stderr


def test_missing_data_file_is_named(tmp_path):
    result = run_deepy("train.py", TINY, f"data_path={tmp_path}/nothing", f"vocab_file={tmp_path}/t.json", check=False)
    assert result.returncode == 2
    assert f"{tmp_path}/nothing" in result.stderr


def test_flash_pattention_reproduces_the_fused_losses(baseline_run, demo_data, tmp_path):
    """The baseline trains with pattention_impl auto, the default, which takes fused here (the step fits this
    machine's memory many times over) and says so; flash, the tiled path, must give the same 20 iterations
    (DP=2, ZeRO-1) within 1e-4 relative: the implementations compute the same function. The flash run gives
    peak_tflops, so its log has an MFU: its FLOP/s per device over that peak."""
    run_dir, baseline = baseline_run
    assert baseline.stdout.count("pattention_impl: auto -> fused: fused fits") == 1, baseline.stdout
    result = run_deepy("train.py", TINY, *data_overrides(demo_data), "pattention_impl=flash", "train_iters=20",
                       "peak_tflops=0.5", f"log_dir={tmp_path}/logs")
    fused = train_losses(run_dir / "logs")
    flash = train_losses(tmp_path / "logs")
    assert sorted(flash) == list(range(1, 21))
    differences = [(i, flash[i], fused[i]) for i in flash if abs(flash[i] - fused[i]) > 1e-4 * abs(fused[i])]
    assert not differences, differences
    train = [r for r in read_metrics(tmp_path / "logs") if r["split"] == "train"]
    for r in train:
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5, rel=1e-12)
        assert r["tflops_per_device"] == pytest.approx(r["flops_per_sec"] / 2 / 1e12, rel=1e-12)
    assert "| MFU " in result.stdout and "GFLOP/s/device" in result.stdout


def test_triton_kernels_train_on_a_cpu_under_the_interpreter(baseline_run, demo_data, tmp_path):
    """pattention_impl=flash flash_backend=kernels on a CPU: the ranks switch Triton's interpreter on before
    anything imports triton, and flash's kernels' 2 iterations (the second after an update their backward
    computed) equal fused's (the baseline) within 1e-4. No validation at the end: under the interpreter it is a
    fifth of the run's CPU time, and the losses compared are the training ones."""
    run_dir, _ = baseline_run
    env_free = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run_deepy("train.py", TINY, *data_overrides(demo_data), "pattention_impl=flash", "flash_backend=kernels",
              "train_iters=2", "eval_iters=0", f"log_dir={tmp_path}/logs", env=env_free)
    fused = train_losses(run_dir / "logs")
    triton = train_losses(tmp_path / "logs")
    assert sorted(triton) == [1, 2]
    assert all(abs(triton[i] - fused[i]) <= 1e-4 * abs(fused[i]) for i in triton), triton

"""Damaged, foreign and unsafe checkpoints are refused by name, and a full disk fails a save cleanly.

A real 2-rank run (ZeRO-1) writes global_step2 and global_step4; each test damages a copy. Resuming skips
a checkpoint whose manifest does not match (truncated or corrupted file) for the newest intact one, with a
warning naming the file; a checkpoint of another model shape is refused listing the tensors; a pickle that
would run code is refused without being run; a save onto a full (tmpfs) disk raises one clear error and
leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.manifest import checkpoint_files, record_file, write_manifest
from megatron.checkpoint.safety import CheckpointRefused
from megatron.checkpoint.selection import checkpoint_problems, resume_tag
from tests.conftest import read_metrics, run_deepy
from tests.distributed import free_port, run_on_ranks
from tests.test_tensor_parallel_training import TINY, train

pytestmark = pytest.mark.slow

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIMIZER_SHARD = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def overrides(demo_data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json",
            "train_iters=4", "lr_decay_iters=4", "eval_iters=0", "eval_interval=1000", "checkpoint_factor=2",
            f"save={run_dir}/checkpoints", f"log_dir={run_dir}/logs", *extra]


@pytest.fixture(scope="module")
def trained(demo_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained")
    run_on_ranks(2, train, overrides(demo_data, run_dir))
    return run_dir


@pytest.fixture
def checkpoints(trained, tmp_path) -> Path:
    """A copy of the trained run's checkpoints to damage."""
    return Path(shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints"))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


class RunsCode:
    """What an attacker's pickle holds: unpickling it calls `touch`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def refusal_message(checkpoints: Path) -> str:
    with pytest.raises(CheckpointRefused) as refusal:
        resume_tag(str(checkpoints))
    return str(refusal.value)


def test_intact_checkpoints_verify_and_our_files_load_weights_only(checkpoints):
    for tag in ("global_step2", "global_step4"):
        assert checkpoint_problems(checkpoints / tag) == []
    for name in (MODEL_FILE, "rng_state_0.pt", "rng_state_1.pt"):
        torch.load(checkpoints / "global_step4" / name, weights_only=True)


def test_truncated_shard_is_skipped_with_a_warning_and_training_resumes_from_the_previous_one(
        checkpoints, trained, demo_data, tmp_path, capfd):
    truncate(checkpoints / "global_step4" / OPTIMIZER_SHARD)
    run_dir = tmp_path / "resumed"
    run_on_ranks(2, train, overrides(demo_data, run_dir, f"load={checkpoints}", f"save={checkpoints}"))
    warning = capfd.readouterr().err
    assert f"resuming from global_step2 in {checkpoints}; skipped:\n  global_step4: {OPTIMIZER_SHARD} has" in warning
    assert "the manifest says" in warning
    original = {r["iteration"]: r["lm_loss"] for r in read_metrics(trained / "logs")}
    assert {r["iteration"]: r["lm_loss"] for r in read_metrics(run_dir / "logs")} == {3: original[3], 4: original[4]}
    assert checkpoint_problems(checkpoints / "global_step4") == [], "the damaged checkpoint was saved again"


def test_when_no_checkpoint_is_intact_the_run_stops_naming_each_damaged_file(checkpoints):
    flip_a_byte(checkpoints / "global_step4" / MODEL_FILE)
    truncate(checkpoints / "global_step2" / "rng_state_1.pt")
    results = run_on_ranks(2, refusal_message, checkpoints)
    for message in results:
        assert f"global_step4: {MODEL_FILE} does not match its SHA-256 in the manifest (corrupted)" in message
        assert "global_step2: rng_state_1.pt has" in message and "(truncated or overwritten)" in message


def test_unreadable_file_is_refused_by_name_even_without_a_manifest(checkpoints, capsys):
    (checkpoints / "global_step4" / "manifest.json").unlink()
    truncate(checkpoints / "global_step4" / OPTIMIZER_SHARD)
    assert resume_tag(str(checkpoints)) == "global_step2"
    assert f"global_step4: {OPTIMIZER_SHARD} is not a readable torch file (truncated or corrupted)" in (
        capsys.readouterr().err)


def test_interrupted_save_and_a_missing_latest_are_reported(checkpoints, capsys):
    (checkpoints / ".tmp-global_step6").mkdir()
    (checkpoints / ".tmp-global_step6" / MODEL_FILE).write_bytes(b"partial")
    (checkpoints / "latest").unlink()
    assert resume_tag(str(checkpoints)) == "global_step4"
    warning = capsys.readouterr().err
    assert "skipped:\n  .tmp-global_step6: an interrupted save" in warning
    assert "has no `latest` file; resuming from its newest complete checkpoint, global_step4" in warning


def test_pickle_that_would_run_code_is_refused_without_running_it(checkpoints, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    tampered = checkpoints / "global_step4"
    torch.save({"module": RunsCode(marker)}, tampered / MODEL_FILE)
    write_manifest(tampered, [r for name in checkpoint_files(tampered) for r in record_file(tampered, name)])
    assert resume_tag(str(checkpoints)) == "global_step2"
    assert f"global_step4: {MODEL_FILE} refers to posix.system, which loading would run" in capsys.readouterr().err
    assert not marker.exists()


def test_checkpoint_of_another_model_shape_is_refused_listing_the_tensors(checkpoints, demo_data, tmp_path):
    with pytest.raises(AssertionError) as failure:
        run_on_ranks(2, train, overrides(demo_data, tmp_path, f"load={checkpoints}", "ffn_slot_num=128"))
    message = str(failure.value)
    assert (f"load: {checkpoints}/global_step4 does not fit the model this config describes: its config.json "
            "differs in ffn_slot_num (saved 256, this run 128). 4 tensors differ") in message
    for layer in (0, 1):
        for tensor in ("key_param_tokens", "value_param_tokens"):
            assert f"layers.{layer}.mlp.{tensor}: checkpoint [256, 64], this config [128, 64]" in message
        assert f"layers.{layer}.mlp.norm_token_count" not in message  # a scalar of either count


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MB tmpfs: room for one checkpoint of the tiny model (about 4.1 MB), not two."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount_point)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount_point
    subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


def test_disk_full_during_a_save_raises_one_clear_error_and_keeps_the_previous_checkpoint(
        small_disk, demo_data, tmp_path):
    with pytest.raises(AssertionError) as failure:
        run_on_ranks(2, train, overrides(demo_data, tmp_path, f"save={small_disk}", "keep_last_n_checkpoints=1"))
    message = str(failure.value)
    assert f"CheckpointWriteError: could not save checkpoint global_step4 in {small_disk} (" in message
    assert "The previous checkpoint (global_step2) is untouched; make room or set save to another directory" in message
    assert (small_disk / "latest").read_text() == "global_step2"
    assert checkpoint_problems(small_disk / "global_step2") == []
    assert not list(small_disk.glob(".tmp-*")), "the partial checkpoint is removed, freeing the space"


def test_disk_full_under_deepy_is_one_message_per_failing_rank_without_tracebacks(small_disk, demo_data, tmp_path):
    result = run_deepy("train.py", str(TINY), *overrides(demo_data, tmp_path, f"save={small_disk}",
                                                          "keep_last_n_checkpoints=1"),
                       f"master_port={free_port()}", check=False, timeout=300)
    assert result.returncode != 0
    assert "error (rank 0): could not save checkpoint global_step4 in" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "OSError" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("deepy.py: train.py failed")

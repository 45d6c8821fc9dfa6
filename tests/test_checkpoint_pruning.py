"""keep_last_n_checkpoints counts only checkpoints that can be resumed from; a damaged one is set aside, never
deleted, and the newest intact ones are kept. One at the iteration a resumed run saves again is set aside too."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import deepspeed
import torch

from megatron.checkpoint import selection
from megatron.checkpoint.manifest import checkpoint_files, record_file, write_manifest
from megatron.checkpoint.pruning import delete_old_checkpoints
from megatron.checkpoint.save import save_checkpoint
from megatron.config import load_config
from megatron.runtime.process_group import without_deepspeeds_inference_comm_op
from tests.conftest import REPO
from tests.distributed import run_on_ranks

MODEL_FILE = "mp_rank_00_model_states.pt"
WEIGHTS = bytes(range(7, 7 + 64))  # a tensor's bytes, found again in the file to corrupt them


def checkpoint(save: Path, step: int) -> Path:
    """A committed checkpoint: a real torch file (the resume screens its pickle) and its manifest."""
    directory = save / f"global_step{step}"
    directory.mkdir(parents=True)
    torch.save({"module": {"weight": torch.frombuffer(bytearray(WEIGHTS), dtype=torch.uint8)}}, directory / MODEL_FILE)
    write_manifest(directory, [r for name in checkpoint_files(directory) for r in record_file(directory, name)])
    return directory


def corrupt_weights(directory: Path) -> None:
    """One byte of the stored tensor changed: same size, a readable torch file; only its SHA-256 tells."""
    content = bytearray((directory / MODEL_FILE).read_bytes())
    at = content.index(WEIGHTS)
    content[at] ^= 0xFF
    (directory / MODEL_FILE).write_bytes(content)


def names(save: Path) -> list[str]:
    return sorted(path.name for path in save.iterdir())


def test_a_truncated_checkpoint_is_set_aside_and_the_older_intact_one_kept(tmp_path, capsys):
    for step in (10, 20, 30):
        checkpoint(tmp_path, step)
    os.truncate(tmp_path / "global_step20" / MODEL_FILE, 100)
    delete_old_checkpoints(tmp_path, keep=2, newest=30)
    assert names(tmp_path) == ["global_step10", "global_step20.damaged", "global_step30"]
    warning = capsys.readouterr().err
    assert f"warning: global_step20 in {tmp_path} cannot be resumed from (" in warning
    assert "renamed to global_step20.damaged, kept and not counted among keep_last_n_checkpoints=2" in warning
    checkpoint(tmp_path, 40)
    delete_old_checkpoints(tmp_path, keep=2, newest=40)
    assert names(tmp_path) == ["global_step20.damaged", "global_step30", "global_step40"]


def test_the_model_before_a_scheduled_growth_is_neither_counted_nor_deleted(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoint(tmp_path, step)
    delete_old_checkpoints(tmp_path, keep=2, newest=40, lineage=[20])
    assert names(tmp_path) == ["global_step20", "global_step30", "global_step40"]


def test_one_refused_at_resume_is_not_counted_either(tmp_path, capsys):
    for step in (10, 20):
        checkpoint(tmp_path, step)
    corrupt_weights(tmp_path / "global_step20")
    assert selection.resume_tag(str(tmp_path)) == "global_step10"  # the resume's own verification found it
    assert "global_step20: mp_rank_00_model_states.pt does not match its SHA-256" in capsys.readouterr().err
    checkpoint(tmp_path, 30)  # the resumed run's next save
    delete_old_checkpoints(tmp_path, keep=2, newest=30)
    assert names(tmp_path) == ["global_step10", "global_step20.damaged", "global_step30"]
    assert "it failed verification when this run chose where to resume" in capsys.readouterr().err


def test_intact_checkpoints_beyond_the_count_are_deleted_with_their_re_sharded_copies_and_later_ones_left(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoint(tmp_path, step)
    shutil.copytree(tmp_path / "global_step10", tmp_path / "global_step10-tp1pp0dp1")  # re-sharded on resume
    shutil.copytree(tmp_path / "global_step20", tmp_path / "global_step20-tp2pp1dp4")
    delete_old_checkpoints(tmp_path, keep=2, newest=30)
    assert names(tmp_path) == ["global_step20", "global_step20-tp2pp1dp4", "global_step30", "global_step40"]


def test_a_checkpoint_damaged_again_under_a_name_set_aside_before_gets_a_name_of_its_own(tmp_path, capsys):
    """A run resumed from before a damaged checkpoint writes that iteration again; damaged again, it is set aside
    under a name of its own (`.damaged-2`), not onto the first one's, which would raise after the commit."""
    for step in (10, 20, 30):
        checkpoint(tmp_path, step)
    os.truncate(tmp_path / "global_step20" / MODEL_FILE, 100)
    delete_old_checkpoints(tmp_path, keep=2, newest=30)
    shutil.rmtree(tmp_path / "global_step30")  # a run resumed from 10 saves iterations 20 and 30 again
    for step in (20, 30):
        checkpoint(tmp_path, step)
    os.truncate(tmp_path / "global_step20" / MODEL_FILE, 50)
    delete_old_checkpoints(tmp_path, keep=2, newest=30)
    assert names(tmp_path) == ["global_step10", "global_step20.damaged", "global_step20.damaged-2", "global_step30"]
    assert (tmp_path / "global_step20.damaged" / MODEL_FILE).stat().st_size == 100  # the first one untouched
    assert "renamed to global_step20.damaged-2, kept" in capsys.readouterr().err


def resume_past_a_damaged_checkpoint_and_save_it_again(save: str) -> list[str]:
    """One rank: save iterations 10 and 20, damage 20, resume (from 10) and save 20 again, as a training run
    does; the save directory's names."""
    cfg = load_config([REPO / "tests" / "tiny.yml"], ["padded_vocab_size=256", f"save={save}", "num_gpus=1"],
                      world_size=1)
    model = torch.nn.Linear(4, 4)
    without_deepspeeds_inference_comm_op()  # as training does: else DeepSpeed compiles a C++ op on first use
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.001, "torch_adam": True}}})
    for step in (10, 20):
        save_checkpoint(engine, cfg, step, consumed_samples=step)
    os.truncate(Path(save) / "global_step20" / "mp_rank_00_model_states.pt", 100)
    assert selection.resume_tag(save) == "global_step10"
    save_checkpoint(engine, cfg, 20, consumed_samples=20)
    return names(Path(save))


def test_a_damaged_checkpoint_saved_again_at_its_iteration_is_set_aside_not_deleted(tmp_path, capfd):
    """As at any other iteration, the checkpoint that failed verification stays as evidence."""
    [found] = run_on_ranks(1, resume_past_a_damaged_checkpoint_and_save_it_again, str(tmp_path))
    assert found == ["global_step10", "global_step20", "global_step20.damaged", "latest"]
    assert (tmp_path / "global_step20.damaged" / "mp_rank_00_model_states.pt").stat().st_size == 100
    assert (f"warning: global_step20 in {tmp_path} cannot be resumed from (it failed verification when this run "
            "chose where to resume); renamed to global_step20.damaged, kept while this run saves global_step20 "
            "anew") in capfd.readouterr().err

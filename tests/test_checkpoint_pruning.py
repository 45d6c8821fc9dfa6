"""keep_last_n_checkpoints counts only checkpoints that can be resumed from; a damaged one is set aside, never
deleted, and the newest intact ones are kept (issue 30, item 11)."""

from __future__ import annotations

import os
from pathlib import Path

from megatron.checkpoint import selection
from megatron.checkpoint.manifest import checkpoint_files, record_file, write_manifest
from megatron.checkpoint.pruning import delete_old_checkpoints


def checkpoint(save: Path, step: int) -> Path:
    directory = save / f"global_step{step}"
    directory.mkdir(parents=True)
    (directory / "mp_rank_00_model_states.pt").write_bytes(os.urandom(256))
    write_manifest(directory, [r for name in checkpoint_files(directory) for r in record_file(directory, name)])
    return directory


def names(save: Path) -> list[str]:
    return sorted(path.name for path in save.iterdir())


def test_a_truncated_checkpoint_is_set_aside_and_the_older_intact_one_kept(tmp_path, capsys):
    for step in (10, 20, 30):
        checkpoint(tmp_path, step)
    os.truncate(tmp_path / "global_step20" / "mp_rank_00_model_states.pt", 100)
    delete_old_checkpoints(tmp_path, keep=2, newest=30)
    assert names(tmp_path) == ["global_step10", "global_step20.damaged", "global_step30"]
    warning = capsys.readouterr().err
    assert f"warning: global_step20 in {tmp_path} cannot be resumed from (" in warning
    assert "renamed to global_step20.damaged, kept and not counted among keep_last_n_checkpoints=2" in warning
    checkpoint(tmp_path, 40)
    delete_old_checkpoints(tmp_path, keep=2, newest=40)
    assert names(tmp_path) == ["global_step20.damaged", "global_step30", "global_step40"]


def test_one_refused_at_resume_is_not_counted_either(tmp_path, capsys):
    for step in (10, 20):
        checkpoint(tmp_path, step)
    # Same size, other bytes: only hashing finds it, as the resume's verification does
    (tmp_path / "global_step20" / "mp_rank_00_model_states.pt").write_bytes(os.urandom(256))
    tag, _ = selection.newest_usable_tag(str(tmp_path), lambda d: ["corrupted"] if d.name == "global_step20" else [])
    assert tag == "global_step10"
    checkpoint(tmp_path, 30)  # the resumed run's next save
    delete_old_checkpoints(tmp_path, keep=2, newest=30)
    assert names(tmp_path) == ["global_step10", "global_step20.damaged", "global_step30"]
    assert "it failed verification when this run chose where to resume" in capsys.readouterr().err


def test_intact_checkpoints_beyond_the_count_are_deleted_and_later_ones_left(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoint(tmp_path, step)
    delete_old_checkpoints(tmp_path, keep=2, newest=30)
    assert names(tmp_path) == ["global_step20", "global_step30", "global_step40"]

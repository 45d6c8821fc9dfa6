"""Exported weight files get the mode every other new file gets (safetensors alone would leave them 0600)."""

from __future__ import annotations

import torch

from megatron.formats.consolidated import write_safetensors_shards


def test_safetensors_files_have_the_mode_of_the_files_beside_them(tmp_path):
    state = {f"w{i}": torch.full((64,), float(i)) for i in range(3)}
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    one.mkdir(), sharded.mkdir()
    [weights] = write_safetensors_shards(state, one, max_shard_bytes=1 << 20)
    *shards, index = write_safetensors_shards(state, sharded, max_shard_bytes=300)
    assert len(shards) == 3
    (tmp_path / "beside.json").write_text("{}")
    expected = (tmp_path / "beside.json").stat().st_mode & 0o777
    assert expected & 0o044, "the test's umask leaves new files readable by others"
    assert {path.stat().st_mode & 0o777 for path in [weights, *shards, index]} == {expected}

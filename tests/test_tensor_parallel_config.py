"""Tensor-parallel settings that cannot work fail before any process starts, naming the values and the fix;
a checkpoint is only resumed with the tensor-parallel size it was saved with."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megatron.config import Config, ConfigError
from megatron.formats.deepspeed.resume import load_checkpoint

MINIMAL = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "qkv_slot_num": 32, "proj_slot_num": 32,
    "ffn_slot_num": 128, "seq_length": 32, "train_iters": 10, "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
}


def error_of(values: dict, world_size: int | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        Config.from_dict(values, world_size)
    return str(info.value)


@pytest.mark.parametrize("key, value", [
    ("num_attention_heads", 2), ("qkv_slot_num", 34), ("proj_slot_num", 30), ("ffn_slot_num", 130)])
def test_model_parallel_size_must_divide_heads_and_every_slot_count(key, value):
    message = error_of({**MINIMAL, "model_parallel_size": 4, key: value})
    assert f"model_parallel_size 4 does not divide {key} {value}" in message
    assert "choose a model_parallel_size" in message


def test_every_uneven_count_is_named_at_once_with_the_sizes_that_fit():
    message = error_of({**MINIMAL, "model_parallel_size": 3, "num_attention_heads": 4})
    for part in ("num_attention_heads 4", "qkv_slot_num 32", "proj_slot_num 32", "ffn_slot_num 128"):
        assert part in message
    assert message.endswith("choose a model_parallel_size dividing them all: 1, 2, 4")


def test_model_times_pipe_parallel_size_must_divide_the_processes():
    message = error_of({**MINIMAL, "model_parallel_size": 2}, world_size=3)
    assert "world_size 3 is not divisible by model_parallel_size 2" in message
    assert message.endswith("change the process count to a multiple of 2, or the parallel sizes to ones whose "
                            "product divides 3 (1, 3)")


def test_valid_tensor_parallel_config_gives_the_data_parallel_batch():
    cfg = Config.from_dict({**MINIMAL, "model_parallel_size": 4, "gradient_accumulation_steps": 1}, world_size=8)
    assert cfg.train_batch_size == 2 * 2  # micro batch × data-parallel size 8 / 4


def test_resuming_with_another_tensor_parallel_size_is_refused_with_the_fix(tmp_path):
    (tmp_path / "global_step10").mkdir()
    (tmp_path / "global_step10" / "config.json").write_text(json.dumps({"model_parallel_size": 2}))
    (tmp_path / "latest").write_text("global_step10")
    cfg = SimpleNamespace(load=str(tmp_path), model_parallel_size=4, pipe_parallel_size=0)
    with pytest.raises(ConfigError, match="saved with model_parallel_size=2 .* resume with model_parallel_size=2"):
        load_checkpoint(engine=None, cfg=cfg, tag="global_step10")

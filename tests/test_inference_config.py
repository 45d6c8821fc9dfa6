"""What deepy.py checks before starting generate.py or eval.py: a checkpoint instead of training data, one
model replica, the prompt file and task names; and the generation keys' GPT-NeoX defaults."""

from __future__ import annotations

import pytest

from megatron.config import ConfigError, check_run_inputs, load_config
from tests.inference_fixtures import TINY


def resolve(*overrides: str, world_size: int = 1):
    return load_config([TINY], [f"num_gpus={world_size}", *overrides], world_size=world_size)


def test_inference_scripts_need_a_checkpoint_not_the_training_data(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    ready = ("data_path=/nonexistent/corpus", f"vocab_file={tmp_path}/tokenizer.json", f"load={tmp_path}")
    check_run_inputs(resolve("user_script=generate.py", *ready), "cpu")
    with pytest.raises(ConfigError, match="missing /nonexistent/corpus.bin"):
        check_run_inputs(resolve("user_script=train.py", *ready), "cpu")
    with pytest.raises(ConfigError, match="needs load \\(a checkpoint directory\\) or eval_ckpt"):
        check_run_inputs(resolve("user_script=generate.py", *ready[:2], "load=/nonexistent/ckpt"), "cpu")


def test_inference_scripts_check_replicas_prompts_and_tasks(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    ready = (f"vocab_file={tmp_path}/tokenizer.json", f"load={tmp_path}")
    with pytest.raises(ConfigError, match="set num_gpus=1"):
        check_run_inputs(resolve("user_script=eval.py", "eval_tasks=[piqa]", *ready, world_size=2), "cpu")
    with pytest.raises(ConfigError, match="text_gen_type input-file needs sample_input_file"):
        check_run_inputs(resolve("user_script=generate.py", "text_gen_type=input-file", *ready), "cpu")
    with pytest.raises(ConfigError, match="eval.py needs eval_tasks"):
        check_run_inputs(resolve("user_script=eval.py", *ready), "cpu")


def test_generation_keys_have_gpt_neox_defaults_and_ranges():
    cfg = resolve()
    assert (cfg.text_gen_type, cfg.maximum_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.recompute,
            cfg.prompt_end, cfg.num_samples) == ("unconditional", 64, 0.0, 0, 0.0, False, "\n", 1)
    with pytest.raises(ConfigError, match="top_p"):
        resolve("top_p=1.5")
    with pytest.raises(ConfigError, match="text_gen_type"):
        resolve("text_gen_type=stream")

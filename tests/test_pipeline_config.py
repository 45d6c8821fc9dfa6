"""Pipeline settings that cannot work fail before any process starts, naming the values and what to change;
a checkpoint resumes only with the pipeline layout it was saved with; pipeline stages get two optimizer
parameter groups each."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megatron.config import Config, ConfigError
from megatron.formats.deepspeed.resume import load_checkpoint
from megatron.training.optimizer import parameter_groups
from tests.conftest import REPO, run_deepy
from tests.test_tensor_parallel_config import MINIMAL, error_of


@pytest.mark.parametrize("pipe_parallel_size, stage", [(2, 2), (1, 2), (4, 3)])
def test_zero_stage_2_and_3_are_refused_with_the_pipeline_engine(pipe_parallel_size, stage):
    message = error_of({**MINIMAL, "pipe_parallel_size": pipe_parallel_size, "num_layers": 4,
                        "zero_optimization": {"stage": stage}})
    assert f"zero_optimization.stage {stage} cannot be combined with pipe_parallel_size {pipe_parallel_size}" in message
    assert "use stage 1" in message and "pipe_parallel_size 0" in message


def test_more_stages_than_layers_are_refused():
    message = error_of({**MINIMAL, "pipe_parallel_size": 3})
    assert "pipe_parallel_size 3 is larger than num_layers 2" in message and "at most num_layers stages" in message


@pytest.mark.parametrize("method", ["profile", "type:[", "type:embedding", "parameter"])
def test_unknown_partition_methods_are_refused(method):
    message = error_of({**MINIMAL, "pipe_partition_method": method})
    assert f"pipe_partition_method {method!r} must be 'parameters', 'uniform' or 'type:REGEX'" in message
    assert "TransformerLayerPipe" in message


@pytest.mark.parametrize("method", ["type:transformer|mlp", "type:TransformerLayerPipe", "parameters", "Uniform"])
def test_partition_methods_of_gpt_neox_are_accepted(method):
    cfg = Config.from_dict({**MINIMAL, "pipe_partition_method": method, "pipe_parallel_size": 2,
                            "zero_optimization": {"stage": 1}}, world_size=4)
    assert cfg.pipe_partition_method == method and cfg.train_batch_size == 2 * 2


@pytest.mark.slow
def test_refusal_comes_before_any_process_starts():
    result = run_deepy("train.py", str(REPO / "tests" / "tiny.yml"), "pipe_parallel_size=2",
                       "zero_optimization={stage: 2}", "data_path=nowhere", check=False, timeout=120)
    assert result.returncode == 2
    assert "zero_optimization.stage 2 cannot be combined with pipe_parallel_size 2" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("saved, resumed", [(2, 0), (0, 1), (2, 4)])
def test_resuming_with_another_pipeline_layout_is_refused_with_the_fix(tmp_path, saved, resumed):
    (tmp_path / "global_step10").mkdir()
    (tmp_path / "global_step10" / "config.json").write_text(
        json.dumps({"model_parallel_size": 1, "pipe_parallel_size": saved}))
    (tmp_path / "latest").write_text("global_step10")
    cfg = SimpleNamespace(load=str(tmp_path), model_parallel_size=1, pipe_parallel_size=resumed)
    with pytest.raises(ConfigError, match=f"saved with pipe_parallel_size={saved} .* resume with "
                                          f"pipe_parallel_size={saved}"):
        load_checkpoint(engine=None, cfg=cfg, tag="global_step10")


def test_a_pipeline_stage_without_norm_parameters_still_gets_two_groups():
    # DeepSpeed's ZeRO all-reduces the gradient norm over all stages once per group: counts must agree
    matrices = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(3)])
    assert len(parameter_groups(matrices, 0.1)) == 1
    decay, split_off = parameter_groups(matrices, 0.1, two_groups=True)
    assert len(decay["params"]) == 2 and len(split_off["params"]) == 1
    assert decay["weight_decay"] == split_off["weight_decay"] == 0.1
    mixed = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))])
    assert [g["weight_decay"] for g in parameter_groups(mixed, 0.1, two_groups=True)] == [0.1, 0.0]
    with pytest.raises(ValueError, match="fewer than two parameters"):
        parameter_groups(torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2, 2))]), 0.1, two_groups=True)

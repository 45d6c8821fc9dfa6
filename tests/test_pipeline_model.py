"""The TokenFormer pipeline (megatron/model/pipeline.py) against TokenFormerModel, on real gloo ranks.

DeepSpeed's topology numbers ranks as our layout does; every stage holds exactly the single-stage model's
parameters (tensor-parallel blocks included) under the documented names, and together the stages hold the
whole model, for tied and untied output layers and every partition method.
"""

from __future__ import annotations

import deepspeed
import pytest
import torch

from megatron import mpu
from megatron.config.validate import PIPELINE_LAYER_CLASS
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.pipeline import TransformerLayerPipe, build_pipeline, pipeline_parameter_model_name
from megatron.mpu import ParallelLayout
from megatron.training.step import lm_loss
from megatron.runtime.process_group import without_deepspeeds_inference_comm_op
from tests.distributed import run_on_ranks


def tiny_args(**overrides) -> TokenFormerArgs:
    values = dict(padded_vocab_size=64, hidden_size=16, num_layers=4, num_attention_heads=2, qkv_slot_num=8,
                  proj_slot_num=8, ffn_slot_num=24, seq_length=12, rotary_pct=0.5, seed=7)
    return TokenFormerArgs(**{**values, **overrides})


@pytest.mark.parametrize("world_size, tensor_size, pipe_size", [(2, 1, 2), (8, 2, 2), (8, 1, 4), (12, 2, 3)])
def test_deepspeed_topology_numbers_ranks_as_our_layout(world_size, tensor_size, pipe_size):
    layout = ParallelLayout(world_size, tensor_size, pipe_size)
    topology = mpu.pipeline_topology(layout)
    for rank in range(world_size):
        coordinate = topology.get_coord(rank)
        assert (coordinate.pipe, coordinate.data, coordinate.model) == layout.coordinates(rank)


def test_validation_names_the_pipeline_layer_class():
    assert TransformerLayerPipe.__name__ == PIPELINE_LAYER_CLASS


def _stage_parameters(tensor_size: int, pipe_size: int, overrides: dict, partition_method: str) -> tuple:
    """(tensor rank, this stage's TokenFormerModel parameter names), after checking their values."""
    layout = mpu.initialize_model_parallel(tensor_size, pipe_size)
    without_deepspeeds_inference_comm_op()
    deepspeed.init_distributed("gloo", verbose=False)
    args = tiny_args(**overrides)
    pipeline = build_pipeline(args, mpu.pipeline_topology(layout), lm_loss, partition_method)
    expected = dict(TokenFormerModel(args).named_parameters())
    names = []
    for name, parameter in pipeline.named_parameters():
        model_name = pipeline_parameter_model_name(name, args.num_layers)
        assert torch.equal(parameter, expected[model_name]), (name, model_name)
        names.append(model_name)
    return mpu.get_tensor_parallel_rank(), names, set(expected)


@pytest.mark.parametrize("tensor_size, pipe_size, overrides, partition_method", [
    (2, 2, {}, "type:transformer|mlp"),
    (1, 2, {"no_weight_tying": True, "pos_emb": "learned", "norm": "layernorm"}, "parameters"),
    (1, 3, {}, "uniform"),
    (2, 2, {"model_type": "transformer"}, "type:transformer|mlp"),
])
@pytest.mark.slow
def test_stages_hold_exactly_the_single_stage_models_parameters(tensor_size, pipe_size, overrides, partition_method):
    results = run_on_ranks(tensor_size * pipe_size, _stage_parameters, tensor_size, pipe_size, overrides,
                           partition_method)
    for tensor_rank in range(tensor_size):
        stages = [names for rank, names, _ in results if rank == tensor_rank]
        held = [name for names in stages for name in names]
        whole_model = results[0][2]
        tied_copies = 0 if overrides.get("no_weight_tying") else 1  # the last stage's embedding copy
        assert set(held) == whole_model and len(held) == len(whole_model) + tied_copies

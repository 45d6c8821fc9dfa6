"""load_model: checkpoints of the real training loop (TP=2; DP=2 with ZeRO-1; PP=2 × TP=2) and their exports
give the training model's logits, in one process without DeepSpeed and re-split over tensor-parallel ranks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

from megatron import mpu
from megatron.inference import load_model
from tests.distributed import run_on_ranks
from tests.inference_fixtures import PROBE
from tools import export_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
# The consolidated model sums each Pattention's tokens in one matmul, the split one in per-rank parts.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def test_tensor_parallel_checkpoint_loads_as_one_model_with_the_training_logits(tensor_parallel_checkpoint):
    save = tensor_parallel_checkpoint.save
    assert sorted(p.name for p in (save / "global_step2").glob("mp_rank_*")) == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    model = load_model(save)
    assert model.word_embeddings.weight.shape == (2048, 64) and not model.training
    torch.testing.assert_close(model(PROBE), tensor_parallel_checkpoint.logits, **TOLERANCE)
    assert torch.equal(load_model(save / "global_step2")(PROBE), model(PROBE))


def test_pipeline_checkpoint_loads_as_one_model_with_the_training_logits(pipeline_checkpoint):
    names = {p.name for p in (pipeline_checkpoint.save / "global_step2").glob("layer_*")}
    assert {"layer_00-model_01-model_states.pt", "layer_05-model_00-model_states.pt"} <= names
    torch.testing.assert_close(load_model(pipeline_checkpoint.save)(PROBE), pipeline_checkpoint.logits, **TOLERANCE)


def _logits_on_tensor_ranks(path) -> torch.Tensor:
    mpu.initialize_model_parallel(2)
    mpu.seed_model_parallel_rng(0)
    try:
        model = load_model(path)
        assert model.word_embeddings.weight.shape[0] == 1024  # this rank's half of the vocabulary
        with torch.no_grad():
            return mpu.gather_from_region(model(PROBE), -1)
    finally:
        mpu.destroy_model_parallel()


@pytest.mark.parametrize("which", ["tensor_parallel_checkpoint", "zero_data_parallel_checkpoint",
                                   "pipeline_checkpoint"])
def test_checkpoint_resplits_over_two_tensor_ranks(which, request):
    checkpoint = request.getfixturevalue(which)
    for logits in run_on_ranks(2, _logits_on_tensor_ranks, checkpoint.save):
        torch.testing.assert_close(logits, checkpoint.logits, **TOLERANCE)


def test_zero_to_fp32_output_loads_with_the_training_logits(zero_data_parallel_checkpoint, tmp_path):
    save = zero_data_parallel_checkpoint.save
    assert len(list((save / "global_step2").glob("zero_pp_rank_*_optim_states.pt"))) == 2
    config = save / "global_step2" / "config.json"
    convert_zero_checkpoint_to_fp32_state_dict(str(save), str(tmp_path / "whole"))
    model = load_model(tmp_path / "whole" / "pytorch_model.bin", config=config)
    torch.testing.assert_close(model(PROBE), zero_data_parallel_checkpoint.logits, **TOLERANCE)
    convert_zero_checkpoint_to_fp32_state_dict(str(save), str(tmp_path / "sharded"), max_shard_size="200KB",
                                               safe_serialization=True)
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    assert len(set(json.loads(index.read_text())["weight_map"].values())) > 1
    assert torch.equal(load_model(index, config=config)(PROBE), model(PROBE))


@pytest.mark.parametrize("flag", [[], ["--safetensors"]])
def test_exports_load_as_the_checkpoint(flag, tensor_parallel_checkpoint, tmp_path):
    weights = export_checkpoint.main([str(tensor_parallel_checkpoint.save), str(tmp_path / "export"), *flag])
    assert weights.name == ("model.safetensors" if flag else "pytorch_model.bin")
    expected = load_model(tensor_parallel_checkpoint.save)(PROBE)
    assert torch.equal(load_model(tmp_path / "export")(PROBE), expected)
    assert torch.equal(load_model(weights)(PROBE), expected)
    if not flag:
        state = torch.load(weights, weights_only=True)
        assert all(t.dtype in (torch.float32, torch.int64) for t in state.values())
    with pytest.raises(SystemExit):  # "the output directory ... exists and is not empty" (test_inference_input_checks)
        export_checkpoint.main([str(tensor_parallel_checkpoint.save), str(tmp_path / "export"), "--safetensors"])
    assert torch.equal(load_model(weights)(PROBE), expected)


def test_a_config_that_does_not_describe_the_checkpoint_is_refused(tensor_parallel_checkpoint):
    with pytest.raises(ValueError, match=r"num_layers: saved 2, given 3"):
        load_model(tensor_parallel_checkpoint.save, config=tensor_parallel_checkpoint.config("num_layers=3"))


def test_a_missing_tensor_rank_file_is_named(tensor_parallel_checkpoint, tmp_path):
    copy = tmp_path / "global_step2"
    shutil.copytree(tensor_parallel_checkpoint.save / "global_step2", copy)
    (copy / "mp_rank_00_model_states.pt").unlink()
    (copy / "manifest.json").unlink()  # with it, the manifest names the missing file (test_inference_input_checks)
    with pytest.raises(FileNotFoundError, match="tensor ranks \\[1\\] found"):
        load_model(copy)


def test_weights_without_a_config_ask_for_one(tensor_parallel_checkpoint, tmp_path):
    weights = export_checkpoint.main([str(tensor_parallel_checkpoint.save), str(tmp_path)])
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="pass config="):
        load_model(weights)

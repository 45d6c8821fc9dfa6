"""DeepSpeed's universal checkpoint on checkpoints of the real training loop (forked gloo ranks, tests/tiny.yml):
DeepSpeed 0.19.8's own converter (`python -m deepspeed.checkpoint.ds_to_universal`, in a subprocess) and its own
loader (a fresh engine built as the Trainer builds it, with `checkpoint: {load_universal: true}`, then
`engine.load_checkpoint`). What works and what does not is in docs/growth.md, "DeepSpeed's universal checkpoint".

- Our model files carry no `universal_checkpoint_info`: the converter refuses every layout without
  `--inject_missing_state` (its assertion). ZeRO stage 0 writes no optimizer shards: refused whatever the options.
- DP=2 ZeRO-1 converts with it and loads into DP=3: weights, fp32 masters, Adam's moments and step bit-identical.
- TP=2 converts with it, but every parameter is concatenated along dim 0 over the tensor ranks, the replicated
  final norm too: it loads back only at TP=2 (exactly, here TP=2 × DP=2); TP=1 fails with DeepSpeed's numel
  assertion. With one hand-written pattern naming the final norm as replicated it loads into TP=1 exactly.
- Pipeline checkpoints (pipe_parallel_size 1, demo.yml's and the model configs' layout, and 2) are refused: the
  converter wants a `layer_01*` file, and our layer 1 is the parameter-free pass-through. With an empty `layer_01`
  file added by hand, the one-stage pipeline converts and loads exactly.
- The grow tool's output has no ZeRO shards (its optimizer state is portable) and is refused. A grown model
  trained on converts and loads every parameter and its Adam state exactly, but the loader restores no
  buffers: every `norm_token_count` restarts at the fresh model's n', not the checkpoint's n, which changes
  the function (docs/growth.md, "Why the function stays the same").

Each expected failure asserts DeepSpeed's message, so a DeepSpeed that changes behaviour fails here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import yaml

from megatron.formats.deepspeed.names import tokenformer_name
from megatron.formats.deepspeed.reader import open_checkpoint
from megatron.runtime.process_group import initialize_distributed
from megatron.training.pretrain import setup_model_and_engine
from tests.conftest import REPO
from tests.distributed import run_on_ranks
from tests.test_growth_state_io import SourceRun, config, live_state, run_overrides, whole
from tools.grow_checkpoint import grow_checkpoint

pytestmark = pytest.mark.slow

TINY = REPO / "tests" / "tiny.yml"
HIDDEN = 64  # tests/tiny.yml's hidden_size
DOUBLED = {"qkv_slot_num": 128, "proj_slot_num": 128, "ffn_slot_num": 512}
MISSING_INFO = ("AssertionError: Required universal_checkpoint_info state is missing in checkpoint. "
                "Verify that client creates this state.")


def ds_to_universal(step_dir: Path, out_root: Path, *options: str) -> subprocess.CompletedProcess:
    """DeepSpeed's converter on `step_dir`, writing `out_root/<tag>` and `out_root/latest_universal`."""
    return subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(step_dir),
         "--output_folder", str(out_root / step_dir.name), "--num_extract_workers", "1", "--num_merge_workers", "1",
         *options], capture_output=True, text=True, timeout=300)


def converted(step_dir: Path, out_root: Path) -> Path:
    result = ds_to_universal(step_dir, out_root, "--inject_missing_state")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (out_root / "latest_universal").read_text() == step_dir.name
    return out_root


def universal_param(out_root: Path, tag: str, name: str, state: str = "fp32") -> torch.Tensor:
    return torch.load(out_root / tag / "zero" / name / f"{state}.pt", weights_only=False)["param"]


def load_universal(root: Path, overrides: list[str]) -> dict:
    """One rank: a fresh engine loads DeepSpeed's universal checkpoint `root` (its latest_universal); this rank's
    state as the source runs report theirs, the iteration, and the module weights that differ from the masters."""
    cfg = config(overrides, dist.get_world_size())
    initialize_distributed(cfg)
    engine = setup_model_and_engine(cfg, deepspeed_extra={"checkpoint": {"load_universal": True}})[0]
    with torch.no_grad():
        _, client_state = engine.load_checkpoint(str(root), load_lr_scheduler_states=False)
    state = live_state(SimpleNamespace(engine=engine, cfg=cfg))
    masters = {name: tensors[0] for name, tensors in state["entries"].items()}
    state["weights_not_masters"] = [
        name for name, parameter in engine.module.named_parameters()
        if not torch.equal(parameter, masters[tokenformer_name(name, cfg.num_layers, cfg.pipe_parallel_size >= 1)])]
    state["iteration"] = client_state["iteration"]
    return state


def loaded(root: Path, world_size: int, demo_data: Path, run_dir: Path, *layout: str) -> list[dict]:
    return run_on_ranks(world_size, load_universal, root, run_overrides(demo_data, run_dir, *layout))


def assert_same_state(got: dict[str, tuple], expected: dict[str, tuple]) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensors in expected.items():
        for have, want in zip(got[name], tensors):
            assert (have is None) == (want is None), name
            assert want is None or (have.dtype == want.dtype and torch.equal(have, want)), name


def assert_loads_exactly(ranks: list[dict], source: SourceRun, iteration: int) -> None:
    source_config = open_checkpoint(source.checkpoints).config
    got, got_steps = whole(ranks, source_config)
    expected, expected_steps = whole(source.ranks, source_config)
    assert_same_state(got, expected)
    assert got_steps == expected_steps == {iteration}
    assert {rank["iteration"] for rank in ranks} == {iteration}
    assert all(rank["weights_not_masters"] == [] for rank in ranks)


@pytest.fixture(scope="module")
def data_2_zero_1(demo_data, tmp_path_factory) -> SourceRun:
    """3 iterations on 2 data-parallel ranks, ZeRO stage 1 (tests/tiny.yml's layout); its ranks' state after the
    save of global_step3."""
    return SourceRun(2, tmp_path_factory.mktemp("dp2_zero1"), demo_data)


def test_the_converter_needs_state_our_checkpoints_do_not_write(data_2_zero_1, tmp_path):
    result = ds_to_universal(data_2_zero_1.checkpoints / "global_step3", tmp_path / "universal")
    assert result.returncode != 0
    assert MISSING_INFO in result.stderr
    assert not (tmp_path / "universal" / "latest_universal").exists()


def test_zero_stage_0_checkpoints_have_no_optimizer_shards_to_convert(demo_data, tmp_path):
    source = SourceRun(1, tmp_path / "run", demo_data, "zero_optimization={stage: 0}", iterations=1)
    step_dir = source.checkpoints / "global_step1"
    result = ds_to_universal(step_dir, tmp_path / "universal", "--inject_missing_state")
    assert result.returncode != 0
    assert f"FileNotFoundError: can't find *_optim_states.pt files in directory '{step_dir}'" in result.stderr


def test_data_parallel_zero_1_converts_and_loads_into_3_ranks_exactly(data_2_zero_1, demo_data, tmp_path):
    root = converted(data_2_zero_1.checkpoints / "global_step3", tmp_path / "universal")
    ranks = loaded(root, 3, demo_data, tmp_path / "dp3")
    assert_loads_exactly(ranks, data_2_zero_1, iteration=3)


def test_tensor_parallel_loads_back_only_at_the_same_tensor_parallel_size(demo_data, tmp_path):
    source = SourceRun(2, tmp_path / "tp2", demo_data, "model_parallel_size=2")
    step_dir = source.checkpoints / "global_step3"
    root = converted(step_dir, tmp_path / "universal")
    # Every parameter is concatenated along dim 0 over the tensor ranks: right for the parameter tokens and the
    # vocabulary (split along rows), wrong for the final norm, which every tensor rank holds whole.
    assert universal_param(root, "global_step3", "final_norm.weight").shape == (2 * HIDDEN,)
    assert universal_param(root, "global_step3", "layers.0.mlp.key_param_tokens").shape == (256, HIDDEN)

    assert_loads_exactly(loaded(root, 4, demo_data, tmp_path / "tp2dp2", "model_parallel_size=2"), source, 3)
    error = (r"AssertionError: Loading \S+/zero/final_norm\.(weight|bias)/(fp32|exp_avg|exp_avg_sq)\.pt full param "
             rf"numel {2 * HIDDEN} != tensor slice numel {HIDDEN} \* tp_world_size 1")
    with pytest.raises(AssertionError, match=error):
        loaded(root, 2, demo_data, tmp_path / "tp1dp2")

    # DeepSpeed's metadata for the replicated final norm, written by hand into a copy, is all TP=1 needs.
    patched = tmp_path / "with_info" / step_dir.name
    shutil.copytree(step_dir, patched)
    for model_file in patched.glob("mp_rank_*_model_states.pt"):
        state = torch.load(model_file, weights_only=False)
        state["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.4,
                                              "tp_replicated_parameter_patterns": [r"final_norm\..*"]}
        torch.save(state, model_file)
    result = ds_to_universal(patched, tmp_path / "universal_with_info")
    assert result.returncode == 0, result.stdout + result.stderr
    assert universal_param(tmp_path / "universal_with_info", "global_step3", "final_norm.weight").shape == (HIDDEN,)
    ranks = loaded(tmp_path / "universal_with_info", 2, demo_data, tmp_path / "tp1dp2_with_info")
    assert_loads_exactly(ranks, source, 3)


@pytest.mark.parametrize("stages", [1, 2])
def test_pipeline_checkpoints_are_refused_for_a_missing_layer_01_file(stages, demo_data, tmp_path):
    source = SourceRun(2, tmp_path / "run", demo_data, f"pipe_parallel_size={stages}", iterations=1)
    step_dir = source.checkpoints / "global_step1"
    assert not list(step_dir.glob("layer_01*")) and list(step_dir.glob("layer_02-model_00-model_states.pt"))
    result = ds_to_universal(step_dir, tmp_path / "universal", "--inject_missing_state")
    assert result.returncode != 0
    assert (f"AssertionError: {step_dir} seems a bogus DeepSpeed checkpoint folder: Cannot find layer_01* files "
            "in there.") in result.stderr
    if stages == 1:
        # The folder check is the only obstacle for one stage: with an empty layer_01 file (by hand, in a copy) it
        # converts and loads into DP=1 exactly.
        patched = tmp_path / "with_layer_01" / step_dir.name
        shutil.copytree(step_dir, patched)
        torch.save({}, patched / "layer_01-model_00-model_states.pt")
        root = converted(patched, tmp_path / "universal_with_layer_01")
        ranks = loaded(root, 1, demo_data, tmp_path / "dp1", "pipe_parallel_size=1")
        assert_loads_exactly(ranks, source, iteration=1)


def test_a_grown_model_loads_its_parameters_but_not_its_token_counts(data_2_zero_1, demo_data, tmp_path):
    target = tmp_path / "target.yml"
    target.write_text(yaml.safe_dump({"data_path": f"{demo_data}/demo_text_document",
                                      "vocab_file": f"{demo_data}/tokenizer.json", **DOUBLED}), encoding="utf-8")
    grown, _ = grow_checkpoint(data_2_zero_1.checkpoints, tmp_path / "grown", [TINY, target])
    result = ds_to_universal(grown, tmp_path / "universal_of_grown", "--inject_missing_state")
    assert result.returncode != 0
    assert f"FileNotFoundError: can't find *_optim_states.pt files in directory '{grown}'" in result.stderr

    doubled = [f"{key}={value}" for key, value in DOUBLED.items()]
    trained = SourceRun(2, tmp_path / "trained", demo_data, f"load={grown.parent}", *doubled, iterations=4)
    root = converted(trained.checkpoints / "global_step4", tmp_path / "universal")
    ranks = loaded(root, 1, demo_data, tmp_path / "dp1", *doubled)

    source_config = open_checkpoint(trained.checkpoints).config
    got, got_steps = whole(ranks, source_config)
    expected, expected_steps = whole(trained.ranks, source_config)
    counts = {name for name in expected if name.endswith("norm_token_count")}
    assert len(counts) == 5 * source_config.num_layers
    assert_same_state({k: v for k, v in got.items() if k not in counts},
                      {k: v for k, v in expected.items() if k not in counts})
    assert got_steps == expected_steps == {4} and ranks[0]["weights_not_masters"] == []
    for name in counts:
        new, old = (512, 256) if ".mlp." in name else (128, 64)
        assert (int(expected[name][0]), int(got[name][0])) == (old, new), name

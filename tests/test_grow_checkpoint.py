"""Growth end to end, with the real Trainer on forked gloo ranks (tests/tiny.yml, fp32, ZeRO-1).

A checkpoint grown ×2 evaluates to the validation loss of the checkpoint it was grown from (1e-5 relative):
TP=1 × PP=1 × DP=2 into TP=2 (through the CLI) and into one process, TP=2 × PP=2 into TP=4 × PP=1, for
l2_norm_gelu and (one process) gelu_l2_norm; re-sharding without growth likewise. Training continues from
it with the optimizer state carried over: with clipping off, the first update of the old tokens equals
the update of the un-grown checkpoint on the same batch, new keys move at the first step and new values
at the second. pretrain_partial_init starts from the same weights as the tool's output. The CLI's refusals
name what is wrong."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from megatron import mpu
from megatron.checkpoint.engine_optimizer import base_optimizer
from megatron.config import ConfigError, load_config
from megatron.formats.deepspeed.files import write_checkpoint
from megatron.formats.deepspeed.reader import CheckpointUnreadable, open_checkpoint
from megatron.growth import grow_checkpoint as grow_writer
from megatron.growth.plan import SOFTMAX_GROWTH
from megatron.formats.registry import read_state
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.training.data import batch_iterator
from megatron.training.pretrain import Trainer
from tests.conftest import REPO
from tests.distributed import run_on_ranks
from tests.test_growth_plan import official_reference
from tools import grow_checkpoint as grow_tool
from tools.grow_checkpoint import grow_checkpoint

pytestmark = pytest.mark.slow

TINY = REPO / "tests" / "tiny.yml"
DOUBLED = {"qkv_slot_num": 128, "proj_slot_num": 128, "ffn_slot_num": 512}
SINGLE_PROCESS = {"model_parallel_size": 1, "pipe_parallel_size": 0}
TOLERANCE = 1e-5


def data(demo_data: Path) -> dict:
    """Data, and a global batch of 16 whatever the data-parallel size, so evaluations see the same batches."""
    return {"data_path": f"{demo_data}/demo_text_document", "vocab_file": f"{demo_data}/tokenizer.json",
            "train_batch_size": 16, "gradient_accumulation_steps": None, "eval_iters": 2, "eval_interval": 1000}


def overrides(values: dict) -> list[str]:
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]  # JSON values are YAML


def target_yaml(path: Path, values: dict) -> Path:
    """The next stage's config: a file merged after tests/tiny.yml."""
    path.write_text(yaml.safe_dump(values), encoding="utf-8")
    return path


def trainer_on_this_rank(values: dict) -> Trainer:
    world = dist.get_world_size()
    return Trainer(load_config([TINY], [*overrides(values), f"num_gpus={world}"], world_size=world))


def stage(values: dict, steps: int = 0) -> dict:
    """One rank: start a Trainer, evaluate, then train `steps` steps as its loop does. Single-process runs also
    return the weights before and after each step."""
    world = dist.get_world_size()
    trainer = trainer_on_this_rank(values)
    result = {"start": trainer.state.iteration, "valid": trainer.evaluate(), "losses": [], "weights": []}
    cfg, engine = trainer.cfg, trainer.engine

    def snapshot() -> None:
        if world == 1:
            result["weights"].append({k: v.detach().clone() for k, v in engine.module.state_dict().items()})

    batches = batch_iterator(trainer.splits.train, trainer.state.consumed_samples, cfg.train_micro_batch_size_per_gpu,
                             mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
    snapshot()
    for offset in range(steps):
        trainer.schedule.apply(trainer.optimizer, trainer.state.iteration + offset)
        result["losses"].append(trainer.train_step(batches)[0])
        snapshot()
    trainer.metrics.close()
    return result


def train_and_evaluate(values: dict) -> float:
    """One rank: train (saving at the end), then the validation loss."""
    trainer = trainer_on_this_rank(values)
    trainer.train()
    trainer.metrics.close()
    return trainer.evaluate()


@dataclass(frozen=True)
class Source:
    save: Path
    valid: float
    values: dict


def trained(world_size: int, directory: Path, values: dict) -> Source:
    values = {**values, "save": str(directory)}
    return Source(directory, run_on_ranks(world_size, train_and_evaluate, values)[0], values)


@pytest.fixture(scope="module")
def source(demo_data, tmp_path_factory) -> Source:
    """3 iterations of DeepSpeed's pipeline engine (one stage, the demo's layout) on 2 data-parallel ranks."""
    return trained(2, tmp_path_factory.mktemp("source"), {**data(demo_data), "pipe_parallel_size": 1,
                                                           "train_iters": 3})


@pytest.fixture(scope="module")
def grown_single(source, tmp_path_factory) -> Path:
    """The source grown ×2 into one process (library)."""
    directory = tmp_path_factory.mktemp("grown_single") / "checkpoints"
    config = target_yaml(directory.parent / "target.yml", {**source.values, **DOUBLED, **SINGLE_PROCESS})
    return grow_checkpoint(source.save, directory, [TINY, config])[0].parent


def assert_same_loss(got: float, expected: float) -> None:
    assert abs(got - expected) <= TOLERANCE * abs(expected), (got, expected)


def test_the_cli_grows_tp1_into_tp2_with_the_same_loss_and_training_continues(source, tmp_path):
    target = {**source.values, **DOUBLED, "model_parallel_size": 2, "pipe_parallel_size": 0}
    files_before = {path: path.stat().st_mtime_ns for path in source.save.rglob("*")}
    result = subprocess.run(
        [sys.executable, "tools/grow_checkpoint.py", "--load", str(source.save), "--save", str(tmp_path / "grown"),
         "--config", str(TINY), str(target_yaml(tmp_path / "target.yml", target))],
        cwd=REPO, capture_output=True, text=True, check=True)
    assert "ffn_slot_num 256 -> 512" in result.stdout
    assert "model_parallel_size 1, pipe_parallel_size 1 -> model_parallel_size 2, pipe_parallel_size 0" in result.stdout
    assert {path: path.stat().st_mtime_ns for path in source.save.rglob("*")} == files_before  # read only
    ranks = run_on_ranks(2, stage, {**target, "load": str(tmp_path / "grown"), "save": str(tmp_path / "grown"),
                                    "train_iters": 5}, 2)
    assert [r["start"] for r in ranks] == [3, 3]
    assert_same_loss(ranks[0]["valid"], source.valid)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in ranks)


def test_first_update_after_growth_equals_the_ungrown_update_and_new_tokens_learn(source, grown_single, tmp_path):
    resharded = grow_checkpoint(source.save, tmp_path / "resharded", [
        TINY, target_yaml(tmp_path / "target.yml", {**source.values, **SINGLE_PROCESS})])[0].parent
    no_clipping = {"gradient_clipping": 0.0, "weight_decay": 0.0}  # decay would move the new values by itself
    ungrown = run_on_ranks(1, stage, {**source.values, **SINGLE_PROCESS, **no_clipping, "load": str(resharded)},
                           1)[0]
    grown = run_on_ranks(1, stage, {**source.values, **DOUBLED, **SINGLE_PROCESS, **no_clipping,
                                    "load": str(grown_single)}, 2)[0]
    assert ungrown["start"] == grown["start"] == 3
    assert_same_loss(ungrown["valid"], source.valid)  # re-sharding only
    assert_same_loss(grown["valid"], source.valid)
    before, after = ungrown["weights"]
    grown_before, grown_after, grown_later = grown["weights"]
    for name, old in before.items():
        rows = tuple(slice(0, size) for size in old.shape)
        assert torch.equal(grown_before[name][rows], old), name
        update, grown_update = after[name] - old, grown_after[name][rows] - old
        # Equal up to rounding: the grown rows of scores are longer, so their norms are summed in another order
        # (the plain formula too), and Adam magnifies that where a gradient element nearly cancels, well within the
        # tolerance. A lost moment or a wrong n changes updates by their own size.
        torch.testing.assert_close(grown_update, update, rtol=1e-3, atol=1e-3 * update.abs().max().item(),
                                   msg=lambda message: f"{name}: {message}")
    for name, weight in grown_before.items():
        if name.endswith("key_param_tokens"):
            n = before[name].shape[0]
            assert not weight[n:].any() and grown_after[name][n:].abs().sum(dim=1).gt(0).all(), name
        if name.endswith("value_param_tokens"):
            n = before[name].shape[0]
            assert torch.equal(grown_after[name][n:], weight[n:]), name   # no gradient while the keys are zero
            assert not torch.equal(grown_later[name][n:], weight[n:]), name


def test_gelu_l2_norm_growth_keeps_the_loss_and_can_restart_iteration_and_optimizer(demo_data, tmp_path):
    values = {**data(demo_data), **SINGLE_PROCESS, "norm_activation_type": "gelu_l2_norm", "train_iters": 2}
    small = trained(1, tmp_path / "small", values)
    target = target_yaml(tmp_path / "target.yml", {**small.values, **DOUBLED})
    tag_dir = grow_checkpoint(small.save, tmp_path / "grown", [TINY, target], reset_iteration=True,
                              optimizer="reset")[0]
    grown = open_checkpoint(tag_dir)
    assert (tag_dir.name, grown.iteration, grown.consumed_train_samples, grown.optimizer_step) == (
        "global_step0", 0, 0, None)
    evaluated = run_on_ranks(1, stage, {**small.values, **DOUBLED, "load": str(tag_dir.parent), "eval_only": True})[0]
    assert evaluated["start"] == 0
    assert_same_loss(evaluated["valid"], small.valid)


def test_tp2_pp2_grows_into_tp4_pp1_with_the_same_loss(demo_data, tmp_path):
    small = trained(4, tmp_path / "small", {**data(demo_data), "model_parallel_size": 2, "pipe_parallel_size": 2,
                                            "train_iters": 2})
    target = {**small.values, **DOUBLED, "model_parallel_size": 4, "pipe_parallel_size": 1}
    grown = grow_checkpoint(small.save, tmp_path / "grown", [TINY, target_yaml(tmp_path / "target.yml", target)])
    assert sorted(p.name for p in grown[0].glob("layer_02-*")) == [f"layer_02-model_0{r}-model_states.pt"
                                                                   for r in range(4)]
    assert_same_loss(run_on_ranks(4, stage, {**target, "load": str(grown[0].parent)})[0]["valid"], small.valid)


def test_pretrain_partial_init_starts_from_the_tools_output(source, grown_single, tmp_path):
    values = {**source.values, **DOUBLED, **SINGLE_PROCESS, "pretrain_partial_init": str(source.save),
              "load": str(tmp_path / "stage2"), "save": str(tmp_path / "stage2")}
    started = run_on_ranks(1, stage, values)[0]
    assert started["start"] == 0
    assert_same_loss(started["valid"], source.valid)
    tool_output, _ = read_state(grown_single)
    assert all(torch.equal(started["weights"][0][name], weight) for name, weight in tool_output.items())
    frozen_tp2 = run_on_ranks(2, stage, {**values, "model_parallel_size": 2, "freeze_old_param_tokens": True}, 1)
    assert [r["start"] for r in frozen_tp2] == [0, 0]
    assert_same_loss(frozen_tp2[0]["valid"], source.valid)
    assert torch.isfinite(torch.tensor(frozen_tp2[0]["losses"])).all()
    (tmp_path / "empty").mkdir()
    with pytest.raises(AssertionError, match=r"empty holds neither a `latest` file nor a checkpoint's model files"):
        run_on_ranks(1, stage, {**values, "pretrain_partial_init": str(tmp_path / "empty")})


def test_the_cli_refuses_what_it_cannot_do(source, tmp_path):
    def grow(*configs: dict, **options):
        files = [target_yaml(tmp_path / f"target{i}.yml", {**source.values, **values}) for i, values in
                 enumerate(configs)]
        return grow_checkpoint(source.save, tmp_path / "out", [TINY, *files], **options)

    with pytest.raises(ConfigError, match=r"hidden_size \(source 64, target 128\)"):
        grow({"hidden_size": 128, **DOUBLED})
    with pytest.raises(ConfigError, match="ffn_slot_num 256 -> 128 shrinks the model; pass --allow-shrink"):
        grow({"ffn_slot_num": 128})
    with pytest.raises(CheckpointUnreadable, match=r"has no checkpoint 'global_step99' \(it has \['global_step3'\]\)"):
        grow({}, tag="global_step99")
    with pytest.raises(ValueError, match="is inside --load"):
        grow_checkpoint(source.save, source.save / "grown", [TINY])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "file").write_text("")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        grow({})
    shutil.rmtree(tmp_path / "out")

    corrupt = tmp_path / "corrupt"
    shutil.copytree(source.save, corrupt)
    victim = next((corrupt / "global_step3").glob("layer_02-*"))
    victim.write_bytes(victim.read_bytes()[:-8] + b"garbage!")
    with pytest.raises(CheckpointUnreadable, match=f"{victim.name} does not match its SHA-256 in the manifest"):
        grow_checkpoint(corrupt, tmp_path / "out", [TINY, target_yaml(tmp_path / "t.yml", source.values)])
    assert source.save.joinpath("global_step3").is_dir() and not (tmp_path / "out").exists()
    shutil.rmtree(corrupt)
    shutil.copytree(source.save, corrupt)
    shard = next((corrupt / "global_step3").glob("*_optim_states.pt"))
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(CheckpointUnreadable, match=f"{shard.name} has .* bytes, the manifest says"):
        grow_checkpoint(corrupt, tmp_path / "out", [TINY, target_yaml(tmp_path / "t.yml", source.values)])
    assert not (tmp_path / "out").exists()

    softmax = load_config([TINY], [*overrides(source.values), "norm_activation_type=softmax"])
    softmax.padded_vocab_size = 2048
    write_checkpoint([TokenFormerModel(TokenFormerArgs.from_config(softmax)).state_dict()], softmax,
                     tmp_path / "softmax")
    with pytest.raises(ConfigError, match=re.escape(SOFTMAX_GROWTH)):
        grow_checkpoint(tmp_path / "softmax", tmp_path / "out", [TINY, target_yaml(
            tmp_path / "s.yml", {**source.values, **DOUBLED, "norm_activation_type": "softmax"})])


def test_a_rerun_after_a_killed_or_interrupted_grow_writes_and_ctrl_c_is_one_line(source, tmp_path, capsys,
                                                                                  monkeypatch):
    target = target_yaml(tmp_path / "target.yml", {**source.values, **DOUBLED})
    argv = ["--load", str(source.save), "--save", str(tmp_path / "out"), "--config", str(TINY), str(target)]
    # What a SIGKILL mid-write leaves: the hidden staging folder only
    (tmp_path / "out" / ".tmp-global_step3").mkdir(parents=True)
    (tmp_path / "out" / ".tmp-global_step3" / "layer_02-model_00-model_states.pt").write_bytes(b"partial")
    grow_tool.main(argv)
    assert (f"--save {tmp_path / 'out'}: removed .tmp-global_step3, left by an earlier run of this tool that was "
            "stopped before it finished (incomplete)") in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["global_step3", "latest"]

    shutil.rmtree(tmp_path / "out")
    monkeypatch.setattr(grow_writer, "grown_states", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit) as stopped:
        grow_tool.main(argv)
    assert stopped.value.code == 130 and not (tmp_path / "out").exists()
    assert capsys.readouterr().err.splitlines()[-1].endswith(  # the program name is pytest's here
        f": interrupted; --save {tmp_path / 'out'} holds nothing of this run")

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".notes").write_text("")
    with pytest.raises(FileExistsError, match=r"\(nothing is overwritten\); it holds hidden entries only: \.notes$"):
        grow_checkpoint(source.save, tmp_path / "out", [TINY, target])


# --- growth_mode official ------------------------------------------------------------------------------------


def training_start(values: dict) -> dict:
    """One rank: start a Trainer; the iteration it starts at, how many parameters have optimizer state, and (one
    process) the module's weights."""
    trainer = trainer_on_this_rank(values)
    weights = ({name: t.detach().clone() for name, t in trainer.engine.module.state_dict().items()}
               if dist.get_world_size() == 1 else None)
    result = {"iteration": trainer.state.iteration, "weights": weights,
              "optimizer_state": len(base_optimizer(trainer.engine.optimizer).state)}
    trainer.metrics.close()
    return result


def assert_equal_states(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    assert [name for name in expected if not torch.equal(got[name], expected[name])] == []


def test_official_growth_by_the_tool_is_the_official_procedure_in_another_layout(source, tmp_path):
    target = {**source.values, **DOUBLED, "model_parallel_size": 2, "pipe_parallel_size": 2}
    config = target_yaml(tmp_path / "target.yml", target)
    tag_dir, plan = grow_checkpoint(source.save, tmp_path / "grown", [TINY, config], growth_mode="official")
    assert tag_dir.name == "global_step0" and plan.mode == "official"
    grown, grown_config = read_state(tag_dir.parent)
    assert_equal_states(grown, official_reference(read_state(source.save)[0], grown_config))
    assert grown_config.growth_mode == "official"
    started = run_on_ranks(4, training_start, {**target, "load": str(tag_dir.parent)})
    assert [(r["iteration"], r["optimizer_state"]) for r in started] == [(0, 0)] * 4  # a fresh optimizer


def test_official_growth_can_carry_the_optimizer_state_and_the_cli_takes_each_factor(source, tmp_path):
    target = {**source.values, **DOUBLED, **SINGLE_PROCESS}
    config = target_yaml(tmp_path / "target.yml", target)
    carried = grow_tool.main(["--load", str(source.save), "--save", str(tmp_path / "carried"), "--config", str(TINY),
                              str(config), "--growth-mode", "official", "--carry-optimizer",
                              "--norm-token-count", "old"])
    grown = open_checkpoint(carried)
    assert (carried.name, grown.optimizer_step) == ("global_step0", open_checkpoint(source.save).optimizer_step)
    state = grown.state("layers.0.mlp.key_param_tokens")
    assert state.has_moments and not state.exp_avg[256:].any() and state.exp_avg[:256].any()
    assert grown.state("layers.0.mlp.norm_token_count").weight.item() == 256  # the old n
    reset = grow_checkpoint(source.save, tmp_path / "reset", [TINY, config], growth_mode="official")[0]
    assert open_checkpoint(reset).optimizer_step is None
    with pytest.raises(SystemExit):
        grow_tool.main(["--load", str(source.save), "--save", str(tmp_path / "both"), "--config", str(TINY),
                        str(config), "--reset-optimizer", "--carry-optimizer"])


def test_official_pretrain_partial_init_is_the_official_procedure_with_a_fresh_optimizer(source, tmp_path):
    values = {**source.values, **DOUBLED, **SINGLE_PROCESS, "pretrain_partial_init": str(source.save)}
    old, source_config = read_state(source.save)
    runs = {}
    for name, extra in {"official": {"growth_mode": "official"}, "preserve": {},
                        "preserve_reset": {"pretrain_partial_init_reset_optimizer": True},
                        "official_carry": {"growth_mode": "official", "growth_optimizer": "carry"}}.items():
        run = {**values, **extra, "load": str(tmp_path / name), "save": str(tmp_path / name)}
        runs[name] = run_on_ranks(1, training_start, run)[0]
        assert runs[name]["iteration"] == 0
    target_config = load_config([TINY], overrides({**values, "growth_mode": "official",
                                                   "padded_vocab_size": source_config.padded_vocab_size}))
    assert_equal_states(runs["official"]["weights"], official_reference(old, target_config))
    assert runs["official"]["optimizer_state"] == runs["preserve_reset"]["optimizer_state"] == 0
    assert runs["preserve"]["optimizer_state"] > 0  # Adam's moments carried over
    assert runs["official_carry"]["optimizer_state"] == runs["preserve"]["optimizer_state"]
    assert_equal_states(runs["official_carry"]["weights"], runs["official"]["weights"])
    assert_equal_states(runs["preserve_reset"]["weights"], runs["preserve"]["weights"])

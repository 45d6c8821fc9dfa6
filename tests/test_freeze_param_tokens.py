"""freeze_old_param_tokens: after growth only the appended parameter tokens learn.

On the real training loop (Trainer, DeepSpeed, weight decay 0.1) on forked gloo ranks, the old rows of every
Pattention in the saved checkpoint stay bit-identical while the new rows and the embeddings change: DP=2
under ZeRO-1 (a rank's block holds both kinds of rows), TP=2 under ZeRO-2 (tensor rank 0's blocks are all
old rows, rank 1's all new), and two pipeline stages in bf16. A frozen run's checkpoints carry the growth
record with what was frozen and resume frozen, bitwise; without the key all tokens train. The first frozen
run from the grow tool's checkpoint keeps the trainable rows' Adam state and step; from a DeepSpeed checkpoint
saved unfrozen it loads the weights only (that optimizer state covers every token), restarting the bf16
masters of ZeRO stage 0 from them. Freezing without a growth record, or with nothing new to train, is refused
before any work.

Except where the grow tool is under test, the "grown" checkpoint is made without it: tests/tiny.yml trained
one step and saved with a growth record saying every Pattention had half its tokens before growth (which
values the rows hold does not matter to freezing).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from deepspeed.utils import safe_get_full_optimizer_state

from megatron.checkpoint.engine_optimizer import base_optimizer
from megatron.checkpoint.growth_record import GrowthRecordError, read_growth_record, write_growth_record
from megatron.checkpoint.save import save_checkpoint
from megatron.checkpoint.selection import resume_tag
from megatron.config import Config, ConfigError, load_config
from megatron.formats.deepspeed.names import holds_trailing_rows, module_model_names
from megatron.formats.deepspeed.reader import read_checkpoint
from megatron.growth.freezing import run_growth
from megatron.growth.plan import pattention_entry
from megatron.formats.registry import read_state
from megatron.training.pretrain import Trainer
from tests.conftest import REPO, read_metrics
from tests.distributed import run_on_ranks
from tools.grow_checkpoint import grow_checkpoint

pytestmark = pytest.mark.slow

TINY = REPO / "tests" / "tiny.yml"
GROWN_FROM = {"qkv_slot_num": 32, "proj_slot_num": 32, "ffn_slot_num": 128}  # half of tiny.yml's counts
RECORD = {"format": 1, "grown_from": GROWN_FROM}
FREEZE = "freeze_old_param_tokens=true"
MATRICES = ("key_param_tokens", "value_param_tokens")


def trainer(overrides: list[str]) -> Trainer:
    world_size = dist.get_world_size()
    return Trainer(load_config([TINY], [*overrides, f"num_gpus={world_size}"], world_size=world_size))


def make_grown(overrides: list[str], directory: str) -> None:
    """One rank: train one step, then save it as a grown checkpoint (with RECORD) in `directory`."""
    grown = trainer([*overrides, "train_iters=1"])
    grown.train()
    grown.metrics.close()
    cfg = Config.from_dict({**grown.cfg.to_dict(), "save": directory}, world_size=dist.get_world_size())
    save_checkpoint(grown.engine, cfg, 1, grown.state.consumed_samples, RECORD)


def train(overrides: list[str]) -> None:
    run = trainer(overrides)
    run.train()
    run.metrics.close()


def options(demo_data: Path, *overrides: str) -> list[str]:
    return [f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json",
            "eval_iters=0", "eval_interval=1000", "lr_decay_iters=20", *overrides]


def grow(world_size: int, demo_data: Path, directory: Path, *layout: str) -> Path:
    run_on_ranks(world_size, make_grown, options(demo_data, *layout, f"log_dir={directory}/logs"), str(directory))
    return directory


def train_losses(world_size: int, demo_data: Path, run_dir: Path, *overrides: str) -> dict[int, float]:
    run_on_ranks(world_size, train, options(demo_data, *overrides, f"log_dir={run_dir}/logs"))
    return {r["iteration"]: r["lm_loss"] for r in read_metrics(run_dir / "logs") if r["split"] == "train"}


def assert_only_new_tokens_changed(before: Path, after: Path) -> None:
    """Old rows bit-identical, new rows of every matrix and the embeddings changed (whole-model weights)."""
    old, new = read_state(before)[0], read_state(after)[0]
    checked = 0
    for name in old:
        entry = pattention_entry(name)
        if entry is None or entry[1] not in MATRICES:
            continue
        frozen = GROWN_FROM[entry[0]]
        assert torch.equal(new[name][:frozen], old[name][:frozen]), f"{name}: an old token changed"
        assert not torch.equal(new[name][frozen:], old[name][frozen:]), f"{name}: no new token learned"
        checked += 1
    assert checked == 2 * 2 * 5  # 2 layers × 5 Pattentions × key and value
    assert not torch.equal(new["word_embeddings.weight"], old["word_embeddings.weight"])


@pytest.fixture(scope="module")
def grown_dp2(demo_data, tmp_path_factory) -> Path:
    return grow(2, demo_data, tmp_path_factory.mktemp("grown_dp2"))


def test_zero_1_data_parallel_keeps_old_tokens_and_resumes_frozen_bitwise(grown_dp2, demo_data, tmp_path):
    run_dir = tmp_path / "frozen"
    losses = train_losses(2, demo_data, run_dir, FREEZE, f"load={grown_dp2}", f"save={run_dir}/checkpoints",
                          "train_iters=5", "extra_save_iters=[3]")
    assert sorted(losses) == [2, 3, 4, 5] and losses[5] < losses[2], losses
    assert_only_new_tokens_changed(grown_dp2, run_dir / "checkpoints")
    step_3 = run_dir / "checkpoints" / "global_step3"
    assert read_growth_record(step_3) == {**RECORD, "frozen": GROWN_FROM}

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(step_3, resumed_dir / "global_step3")
    (resumed_dir / "latest").write_text("global_step3")
    resumed = train_losses(2, demo_data, tmp_path / "resume", FREEZE, f"load={resumed_dir}", f"save={resumed_dir}",
                           "train_iters=5")
    assert resumed == {4: losses[4], 5: losses[5]}
    assert_only_new_tokens_changed(grown_dp2, resumed_dir)


def test_without_the_key_all_tokens_train_and_the_record_is_carried(grown_dp2, demo_data, tmp_path):
    train_losses(2, demo_data, tmp_path, f"load={grown_dp2}", f"save={tmp_path}/checkpoints", "train_iters=2")
    old, new = read_state(grown_dp2)[0], read_state(tmp_path / "checkpoints")[0]
    rows = GROWN_FROM["ffn_slot_num"]
    assert not torch.equal(new["layers.0.mlp.value_param_tokens"][:rows], old["layers.0.mlp.value_param_tokens"][:rows])
    assert read_growth_record(tmp_path / "checkpoints" / "global_step2") == RECORD


@pytest.mark.parametrize("layout", [
    # tensor parallel under ZeRO-2: one rank's blocks all frozen, the other's all trainable
    ("model_parallel_size=2", "zero_optimization={stage: 2}"),
    # two pipeline stages in bf16
    ("pipe_parallel_size=2", "bf16={enabled: true}"),
], ids=["tensor_2_zero_2", "pipe_2_bf16"])
def test_other_layouts_keep_old_tokens(layout, demo_data, tmp_path):
    grown = grow(2, demo_data, tmp_path / "grown", *layout)
    run_dir = tmp_path / "frozen"
    train_losses(2, demo_data, run_dir, *layout, FREEZE, f"load={grown}", f"save={run_dir}", "train_iters=3")
    assert_only_new_tokens_changed(grown, run_dir)


def test_a_weights_only_load_restarts_the_bf16_masters_without_zero(demo_data, tmp_path):
    # The grown checkpoint's optimizer state does not fit a frozen run, so only its weights are loaded. With a
    # learning rate far below bf16's resolution a step then leaves every weight as loaded, unless the fp32
    # masters of DeepSpeed's bf16 optimizer were left at the weights it was built with.
    layout = ("bf16={enabled: true}", "zero_optimization={stage: 0}")
    grown = grow(1, demo_data, tmp_path / "grown", *layout)
    train_losses(1, demo_data, tmp_path, *layout, FREEZE, "optimizer={type: Adam, params: {lr: 1.0e-30}}",
                 "min_lr=0", f"load={grown}", f"save={tmp_path}/checkpoints", "train_iters=2")
    old, new = read_state(grown)[0], read_state(tmp_path / "checkpoints")[0]
    assert [name for name in old if not torch.equal(new[name], old[name])] == []


def trainable_rows_state(overrides: list[str]) -> tuple[dict[str, tuple[torch.Tensor, ...]], set[int]]:
    """One rank, after loading: (weight, exp_avg, exp_avg_sq) of every partly frozen matrix's trainable rows
    under its TokenFormerModel name, and the Adam steps the optimizer holds."""
    run = trainer(overrides)
    cfg = run.cfg
    names = module_model_names(run.engine.module, cfg.num_layers, cfg.pipe_parallel_size >= 1)
    rows = {names[name]: (param.detach().clone(), *(safe_get_full_optimizer_state(param, key).clone()
                                                    for key in ("exp_avg", "exp_avg_sq")))
            for name, param in run.engine.module.named_parameters() if holds_trailing_rows(name)}
    run.metrics.close()
    return rows, {int(state["step"]) for state in base_optimizer(run.engine.optimizer).state.values()}


def test_a_frozen_run_keeps_the_trainable_rows_adam_state_of_the_tools_checkpoint(demo_data, tmp_path):
    # A source carrying a record (every kind grown from half), grown by the tool in ffn_slot_num only: its
    # record then freezes half the qkv/proj tokens (old rows trained before, nonzero moments, now trainable)
    # and the ffn source's tokens (the trainable rows are all new: zero moments).
    source = grow(1, demo_data, tmp_path / "source")
    target = tmp_path / "target.yml"
    target.write_text(yaml.safe_dump({"ffn_slot_num": 512, "num_gpus": 1,
                                     "vocab_file": str(demo_data / "tokenizer.json")}), encoding="utf-8")
    tag_dir = grow_checkpoint(source, tmp_path / "grown", [TINY, target])[0]
    rows, steps = run_on_ranks(1, trainable_rows_state, options(
        demo_data, FREEZE, "ffn_slot_num=512", f"load={tag_dir.parent}", f"log_dir={tmp_path}/logs"))[0]
    grown = read_checkpoint(tag_dir)
    assert steps == {grown.optimizer_step} and grown.optimizer_step > 0
    assert len(rows) == 2 * 2 * 5  # 2 layers × 5 Pattentions × key and value, each partly frozen
    carried = 0
    for name, loaded in rows.items():
        block = grown.block(name, 0)
        expected = [tensor[-len(loaded[0]):] for tensor in (block.weight, block.exp_avg, block.exp_avg_sq)]
        assert all(torch.equal(got, want) for got, want in zip(loaded, expected, strict=True)), name
        new_rows = name.endswith(("mlp.key_param_tokens", "mlp.value_param_tokens"))
        assert (expected[1].count_nonzero() == 0) == new_rows, name
        carried += not new_rows
    assert carried == 2 * 2 * 4  # qkv ×3 and proj per layer


def fake_checkpoint(directory: Path, record: dict | None = None) -> Path:
    """A checkpoint directory with one (empty) tag, enough for choosing what a run resumes."""
    (directory / "global_step1").mkdir(parents=True)
    (directory / "latest").write_text("global_step1")
    (directory / "global_step1" / "config.json").write_text(json.dumps(GROWN_FROM))
    if record is not None:
        write_growth_record(directory / "global_step1", record)
    return directory


def growth_resuming(cfg: Config):
    """What the Trainer finds: the growth of the checkpoint it would resume from `load`."""
    return run_growth(cfg, resume_tag(cfg.load))


def test_freezing_without_a_growth_record_is_refused(tmp_path):
    for load in (tmp_path / "empty", fake_checkpoint(tmp_path / "not_grown")):
        with pytest.raises(ConfigError, match="freeze_old_param_tokens needs a grown checkpoint in `load`"):
            growth_resuming(load_config([TINY], [FREEZE, f"load={load}"]))


def test_freezing_every_token_is_refused(tmp_path):
    load = fake_checkpoint(tmp_path, {"format": 1, "grown_from": {"qkv_slot_num": 64, "proj_slot_num": 64,
                                                                  "ffn_slot_num": 256}})
    with pytest.raises(ConfigError, match="nothing would train"):
        growth_resuming(load_config([TINY], [FREEZE, f"load={load}"]))


def test_pretrain_partial_init_freezes_its_source_slot_counts(tmp_path):
    source = fake_checkpoint(tmp_path / "small")
    growth = growth_resuming(load_config([TINY], [FREEZE, f"load={tmp_path / 'run'}", f"pretrain_partial_init={source}"]))
    assert growth.frozen == GROWN_FROM and growth.record_to_save() == {**RECORD, "frozen": GROWN_FROM}
    assert growth.optimizer_state_fits  # nothing is resumed from `load`


def test_a_malformed_growth_record_is_named(tmp_path):
    (tmp_path / "growth.json").write_text('{"format": 1, "grown_from": {"ffn_slot_num": 0}}')
    with pytest.raises(GrowthRecordError, match=f"{tmp_path / 'growth.json'}: 'grown_from' must map"):
        read_growth_record(tmp_path)
    (tmp_path / "growth.json").write_text("{")
    with pytest.raises(GrowthRecordError, match="is not valid JSON"):
        read_growth_record(tmp_path)

"""norm_token_count_ramp_iters (megatron/growth/norm_ramp.py): n of √n moves from what the grown checkpoint holds
to the token count, exact at the growth; the growth record says where it starts; a run stopped halfway resumes
the same ramp; a checkpoint that cannot say where it starts is refused with the fix."""

from __future__ import annotations

import pytest

from megatron.checkpoint.growth_record import GrowthRecordError, read_growth_record, write_growth_record
from megatron.config import ConfigError, load_config
from megatron.growth.norm_ramp import NormRamp, NormRampApplier, norm_counts, norm_ramp
from megatron.model import TokenFormerArgs, TokenFormerModel
from tests.distributed import run_on_ranks
from tests.test_grow_checkpoint import DOUBLED, SINGLE_PROCESS, TINY, data, target_yaml, trainer_on_this_rank
from tools.grow_checkpoint import grow_checkpoint

COUNTS = {"qkv_slot_num": 128, "proj_slot_num": 128, "ffn_slot_num": 512}
START = {"qkv_slot_num": 64, "proj_slot_num": 64, "ffn_slot_num": 256}


def test_the_ramp_is_exact_at_the_growth_linear_and_whole_then_the_token_count():
    ramp = NormRamp(START, COUNTS, first=10, length=4)
    assert [ramp.count("ffn_slot_num", i) for i in (0, 10, 11, 12, 13, 14, 100)] == [256, 256, 320, 384, 448, 512,
                                                                                   512]
    assert ramp.count("qkv_slot_num", 11) == 80


def test_the_applier_writes_every_pattention_of_a_kind_and_only_when_the_count_changes():
    cfg = load_config([TINY], ["padded_vocab_size=256", *(f"{k}={v}" for k, v in COUNTS.items())])
    model = TokenFormerModel(TokenFormerArgs.from_config(cfg))
    applier = NormRampApplier(model, NormRamp(START, COUNTS, first=0, length=2))
    assert sorted(applier.buffers) == sorted(COUNTS) and len(applier.buffers["ffn_slot_num"]) == cfg.num_layers
    applier.apply(0)
    assert norm_counts(model) == START
    versions = [b._version for b in applier.buffers["ffn_slot_num"]]
    applier.apply(0)
    assert [b._version for b in applier.buffers["ffn_slot_num"]] == versions  # no write: unchanged
    applier.apply(1)
    assert norm_counts(model) == {"qkv_slot_num": 96, "proj_slot_num": 96, "ffn_slot_num": 384}
    applier.apply(7)
    assert norm_counts(model) == COUNTS


def test_a_checkpoint_that_cannot_say_where_the_ramp_starts_is_refused_with_the_fix(tmp_path):
    cfg = load_config([TINY], ["norm_token_count_ramp_iters=5"])
    with pytest.raises(ConfigError, match="it was not grown. Or set norm_token_count_ramp_iters: 0"):
        norm_ramp(cfg, None)
    with pytest.raises(ConfigError, match="predates the ramp: grow the source again"):
        norm_ramp(cfg, {"format": 1, "grown_from": START})
    assert norm_ramp(load_config([TINY]), None) is None
    with pytest.raises(GrowthRecordError, match="'iteration' must be a non-negative integer"):
        write_growth_record(tmp_path, {"format": 1, "grown_from": START, "norm_token_count": START, "iteration": -1})


def ramped_run(values: dict, until: int | None = None) -> dict:
    """One rank: train to `until` (default train_iters); the iteration it started at, each kind's n of √n when it
    started and after training (as set before the last step), and the validation loss at the end."""
    trainer = trainer_on_this_rank(values)
    start = trainer.state.iteration
    counts = [norm_counts(trainer.engine.module)]
    trainer.train(until)
    counts.append(norm_counts(trainer.engine.module))
    final = trainer.evaluate()
    trainer.metrics.close()
    return {"start": start, "counts": counts, "valid": final}


@pytest.mark.slow
def test_a_preserve_growth_ramped_starts_with_the_sources_loss_and_resumes_the_same_ramp(demo_data, tmp_path):
    values = {**data(demo_data), **SINGLE_PROCESS, "train_iters": 2, "save": str(tmp_path / "small"),
              "seed": 3, "checkpoint_factor": 1000}
    small = run_on_ranks(1, ramped_run, values)[0]
    target = target_yaml(tmp_path / "target.yml", {**values, **DOUBLED})
    tag_dir = grow_checkpoint(tmp_path / "small", tmp_path / "grown", [TINY, target], reset_iteration=True)[0]
    record = read_growth_record(tag_dir)
    assert (record["norm_token_count"], record["iteration"]) == (START, 0)
    grown = {**values, **DOUBLED, "norm_token_count_ramp_iters": 4, "train_iters": 6, "load": str(tag_dir.parent)}
    scored = run_on_ranks(1, ramped_run, {**grown, "save": None}, 0)[0]
    assert scored["counts"][0] == START and scored["valid"] == pytest.approx(small["valid"], rel=1e-5)
    whole = run_on_ranks(1, ramped_run, {**grown, "save": str(tmp_path / "whole")})[0]
    assert whole["counts"] == [START, COUNTS]  # set before each step: 256, 320, 384, 448, then 512 from step 5 on
    interrupted = {**grown, "save": str(tmp_path / "halves"), "extra_save_iters": [2]}
    first = run_on_ranks(1, ramped_run, interrupted, 2)[0]
    assert first["counts"][1] == {"qkv_slot_num": 80, "proj_slot_num": 80, "ffn_slot_num": 320}  # before step 2
    resumed = run_on_ranks(1, ramped_run, {**interrupted, "load": str(tmp_path / "halves")})[0]
    assert resumed["start"] == 2 and resumed["counts"][1] == COUNTS
    assert read_growth_record(tmp_path / "halves" / "global_step2")["norm_token_count"] == START
    assert resumed["valid"] == whole["valid"]  # the same ramp: a wrong n at any step would change the loss
    held = run_on_ranks(1, ramped_run, {**grown, "norm_token_count_ramp_iters": 0, "save": None})[0]
    assert held["counts"][1] == START and held["valid"] != whole["valid"]


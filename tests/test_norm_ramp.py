"""norm_token_count_ramp_iters (megatron/growth/norm_ramp.py): n of √n moves from what the grown checkpoint holds
to the token count, exact at the growth, on the pipeline engine at TP = 2 as on one process; the growth record
says where it starts; a checkpoint saved mid-ramp holds the n the ramp gives its iteration, so a run stopped
halfway resumes the same ramp; a checkpoint that cannot say where it starts, or a ramp length changed mid-ramp,
is refused with the fix; a ramp past the run's end or with nothing to ramp is said before launch."""

from __future__ import annotations

import pytest

from pathlib import Path

from megatron.checkpoint.growth_record import GrowthRecordError, read_growth_record, write_growth_record
from megatron.config import ConfigError, load_config
from megatron.config.loader import keys_set
from megatron.formats.deepspeed.files import write_checkpoint
from megatron.growth.norm_ramp import NormRamp, NormRampApplier, norm_counts, norm_ramp
from megatron.growth.notes import launch_notes
from megatron.launch.preflight import preflight_problems
from megatron.model import TokenFormerArgs, TokenFormerModel
from tests.distributed import run_on_ranks
from tests.test_grow_checkpoint import DOUBLED, SINGLE_PROCESS, TINY, data, target_yaml, trainer_on_this_rank
from tests.test_growth_keeps_state import held_norms, mid_ramp_checkpoint, overrides, without_growth_mode
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


# --- ramp settings that cannot work, refused or said before launch ----------------------------------------


def launch(demo_data: Path, base: Path, **values) -> tuple[list[str], list[str]]:
    """(preflight's refusals, the growth notes) of a 2-process training launch of `base` with `values`."""
    data = {"data_path": f"{demo_data}/demo_text_document", "vocab_file": f"{demo_data}/tokenizer.json"}
    cfg = load_config([base], overrides({**data, **DOUBLED, **values}), world_size=2)
    return preflight_problems(cfg, {"localhost": [0, 1]}), launch_notes(cfg, set(values) | set(data) | set(DOUBLED))


def test_a_ramp_length_changed_mid_ramp_is_refused_before_launch(demo_data, tmp_path):
    base = without_growth_mode(tmp_path)
    load = str(mid_ramp_checkpoint(tmp_path / "checkpoints", base).parent)  # iteration 4 of a ramp of 8
    assert launch(demo_data, base, load=load, norm_token_count_ramp_iters=8, train_iters=8) == ([], [])
    problems, _ = launch(demo_data, base, load=load, norm_token_count_ramp_iters=16, train_iters=16)
    assert problems == [
        f"{load}/global_step4: norm_token_count_ramp_iters 16: the checkpoint (iteration 4) was saved by a run with "
        "norm_token_count_ramp_iters 8, so n of √n would jump at the resume (qkv_slot_num 96 -> 80, proj_slot_num 96 "
        "-> 80, ffn_slot_num 384 -> 320) and the function with it; set norm_token_count_ramp_iters: 8 to continue "
        "its ramp"]


def test_a_checkpoint_saved_mid_ramp_resumed_without_a_ramp_is_refused_naming_its_ramp(demo_data, tmp_path):
    """Without the key, n would stay between the two counts for good: refused as another length is, with the fix."""
    base = without_growth_mode(tmp_path)
    load = str(mid_ramp_checkpoint(tmp_path / "checkpoints", base).parent)  # iteration 4 of a ramp of 8
    problems, _ = launch(demo_data, base, load=load, train_iters=8)
    assert problems == [
        f"{load}/global_step4: norm_token_count_ramp_iters 0: the checkpoint (iteration 4) was saved midway through "
        "a ramp of n of √n over 8 iterations, and without one n would stay where it is for good (qkv_slot_num 96 "
        "(from 64 to 128), proj_slot_num 96 (from 64 to 128), ffn_slot_num 384 (from 256 to 512)): neither the "
        "source's function nor the grown model's; set norm_token_count_ramp_iters: 8 to continue its ramp"]
    nothing_to_ramp = str(mid_ramp_checkpoint(tmp_path / "official", base, start=DOUBLED, held=DOUBLED).parent)
    assert launch(demo_data, base, load=nothing_to_ramp, train_iters=8) == ([], [])


def test_a_ramp_longer_than_the_run_or_after_official_growth_and_a_contradiction_are_said(demo_data, tmp_path):
    base = without_growth_mode(tmp_path)
    load = str(mid_ramp_checkpoint(tmp_path / "mid", base).parent)
    assert launch(demo_data, base, load=load, norm_token_count_ramp_iters=8, train_iters=6)[1] == [
        "norm_token_count_ramp_iters 8 ramps n of √n from iteration 0 to 8, past train_iters 6: n never reaches the "
        "token counts; set it to 6 or fewer to reach them"]
    official = str(mid_ramp_checkpoint(tmp_path / "official", base, start=DOUBLED, held=DOUBLED).parent)
    assert launch(demo_data, base, load=official, norm_token_count_ramp_iters=8, train_iters=8)[1] == [
        "norm_token_count_ramp_iters 8 has nothing to ramp: the grown model already normalises by its token count "
        "(official growth, or growth_norm_token_count new); set it to 0, or grow with growth_norm_token_count: old "
        "(preserve's) to start from the source's n"]
    _, notes = launch(demo_data, base, pretrain_partial_init_reset_optimizer=True, growth_optimizer="carry")
    assert notes == ["pretrain_partial_init_reset_optimizer: true and growth_optimizer: carry contradict each other: "
                     "keep one (growth_optimizer: reset is the same as the former). No effect in this run, which grows "
                     "nothing (no pretrain_partial_init); tools/grow_checkpoint.py and pretrain_partial_init refuse "
                     "this config"]


def test_a_launch_that_grows_in_the_default_mode_says_so(demo_data, tmp_path):
    base = without_growth_mode(tmp_path)
    small = load_config([base], ["padded_vocab_size=2048"])
    source = write_checkpoint([TokenFormerModel(TokenFormerArgs.from_config(small)).state_dict()], small,
                              tmp_path / "small").parent
    grows = {"pretrain_partial_init": str(source), "load": str(tmp_path / "stage2")}
    assert launch(demo_data, base, **grows)[1] == [
        "growth_mode official, the default (no config file sets growth_mode): new keys and values from the init and "
        "√n of the new token count, as the official code grows (the grown model computes another function); set "
        "growth_mode: preserve for zero new keys and the old √n (docs/growth.md)"]
    assert launch(demo_data, base, **grows, growth_mode="official")[1] == []
    assert keys_set([base, TINY], ["growth-mode=official", "seed=3"]) >= {"growth_mode", "seed", "num_layers"}
    assert "growth_mode" not in keys_set([base], ["seed=3"])


def ramped_run(values: dict, until: int | None = None) -> dict:
    """One rank: the iteration a Trainer starts at and the n of √n its model holds then, its validation loss there,
    then trained to `until` (default train_iters): the n after training (the ramp's for the last iteration) and the
    validation loss at the end."""
    trainer = trainer_on_this_rank(values)
    start, counts = trainer.state.iteration, [norm_counts(trainer.engine.module)]
    first = trainer.evaluate()
    trainer.train(until)
    counts.append(norm_counts(trainer.engine.module))
    final = trainer.evaluate()
    trainer.metrics.close()
    return {"start": start, "counts": counts, "first": first, "valid": final}


@pytest.mark.slow
def test_a_ramp_on_the_pipeline_engine_at_tp2_starts_with_the_sources_loss_saves_its_n_and_resumes_it(demo_data,
                                                                                                   tmp_path):
    """The layout the real configs use (DeepSpeed's pipeline engine, pipe_parallel_size 1) at tensor parallelism 2,
    where each rank's Pattentions hold half the tokens and normalise by the whole n."""
    values = {**data(demo_data), **SINGLE_PROCESS, "train_iters": 2, "save": str(tmp_path / "small"),
              "seed": 3, "checkpoint_factor": 1000}
    small = run_on_ranks(1, ramped_run, values)[0]
    layout = {"model_parallel_size": 2, "pipe_parallel_size": 1}
    target = target_yaml(tmp_path / "target.yml", {**values, **DOUBLED, **layout})
    tag_dir = grow_checkpoint(tmp_path / "small", tmp_path / "grown", [TINY, target], reset_iteration=True)[0]
    record = read_growth_record(tag_dir)
    assert (record["norm_token_count"], record["iteration"]) == (START, 0)
    grown = {**values, **DOUBLED, **layout, "norm_token_count_ramp_iters": 4, "train_iters": 6,
             "load": str(tag_dir.parent)}
    whole = run_on_ranks(2, ramped_run, {**grown, "save": str(tmp_path / "whole")})[0]
    assert whole["first"] == pytest.approx(small["valid"], rel=1e-5)  # the source's function at the growth
    assert whole["counts"] == [START, COUNTS]  # 256, 320, 384, 448, then 512 from iteration 4 on
    halves = tmp_path / "halves"
    interrupted = {**grown, "save": str(halves), "extra_save_iters": [2]}
    first = run_on_ranks(2, ramped_run, interrupted, 2)[0]
    at_2 = {"qkv_slot_num": 96, "proj_slot_num": 96, "ffn_slot_num": 384}
    assert first["counts"][1] == at_2
    assert held_norms(halves / "global_step2") == at_2  # the saved model is the one the run scored
    assert read_growth_record(halves / "global_step2")["norm_token_count"] == START
    resumed = run_on_ranks(2, ramped_run, {**interrupted, "load": str(halves)})[0]
    assert (resumed["start"], resumed["counts"]) == (2, [at_2, COUNTS])
    assert resumed["first"] == first["valid"]  # what the run scored at iteration 2, from its checkpoint
    assert resumed["valid"] == whole["valid"]  # the same ramp: a wrong n at any step would change the loss
    held = run_on_ranks(2, ramped_run, {**grown, "norm_token_count_ramp_iters": 0, "save": None})[0]
    assert held["counts"][1] == START and held["valid"] != whole["valid"]

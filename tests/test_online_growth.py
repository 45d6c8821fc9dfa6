"""growth_schedule: a running job grows its parameter tokens and goes on, equal to the offline path.

The offline path is the one users had: the run's checkpoint saved at the growth iteration, grown by
tools/grow_checkpoint.py's code (continuing the iteration), resumed with the grown config. Online, the same
job saves that checkpoint, grows and trains on; the losses after the growth must be the offline run's
(fp32 on CPU, no dropout: bitwise, checked within 1e-6 relative), on data-parallel 2 with ZeRO-1 (tests/tiny.yml),
tensor-parallel 2 and pipeline-parallel 2, in each growth mode and with Adam's state carried or reset, with norm_token_count_ramp_iters and with compiled
layers. A resume of
the checkpoint saved at the growth (what a kill during the growth leaves: that checkpoint is committed before the
growth starts) grows again; a resume of a later one builds the grown model; both continue the same losses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron.cli import InputError
from megatron.config import ConfigError, load_config
from megatron.growth.grow_checkpoint import write_grown_checkpoint
from tests.conftest import read_metrics
from tests.distributed import run_on_ranks
from tests.test_tensor_parallel_training import TINY, train

ITERATIONS, GROW_AT = 7, 3
GROWN = {"qkv_slot_num": 128, "ffn_slot_num": 512}  # proj_slot_num stays 64
SCHEDULE = f"growth_schedule=[{{iteration: {GROW_AT}, qkv_slot_num: 128, ffn_slot_num: 512}}]"
LAYOUTS = {"dp2_zero1": [], "tp2": ["model_parallel_size=2"], "pp2": ["pipe_parallel_size=2"]}
MODES = {  # growth keys beside preserve with Adam carried (tests/tiny.yml's growth_mode, the mode's optimizer)
    "official": ["growth_mode=official"],
    "official_carried": ["growth_mode=official", "growth_optimizer=carry"],
    "preserve_reset": ["growth_optimizer=reset"],
    "preserve_ramp": ["norm_token_count_ramp_iters=3"],  # n of √n moves from the old count to the new after it
    "preserve_compiled": ["compile={enable: true, backend: eager}"],  # the grown layers compiled anew (dynamo)
}
RELATIVE_TOLERANCE = 1e-6


def overrides(demo_data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"data_path={demo_data}/demo_text_document", f"vocab_file={demo_data}/tokenizer.json",
            f"train_iters={ITERATIONS}", f"lr_decay_iters={ITERATIONS}", "eval_iters=0", "eval_interval=1000",
            f"save={run_dir}/checkpoints", f"load={run_dir}/checkpoints", f"log_dir={run_dir}/logs", *extra]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in read_metrics(run_dir / "logs") if r["split"] == "train"}


def grow_online(demo_data: Path, run_dir: Path, world: int, *extra: str) -> dict[int, float]:
    run_on_ranks(world, train, overrides(demo_data, run_dir, SCHEDULE, *extra))
    return train_losses(run_dir)


def grow_offline(demo_data: Path, online: Path, run_dir: Path, world: int, *extra: str) -> dict[int, float]:
    """The online run's checkpoint at the growth, grown by the grow tool's code and resumed with the grown config."""
    grown = [*(f"{key}={count}" for key, count in GROWN.items()), *extra]
    target = load_config([TINY], [*overrides(demo_data, run_dir, *grown), f"num_gpus={world}"], world_size=world)
    write_grown_checkpoint(online / "checkpoints" / f"global_step{GROW_AT}", run_dir / "checkpoints", target,
                           reset_iteration=False)
    run_on_ranks(world, train, overrides(demo_data, run_dir, *grown))
    return train_losses(run_dir)


def assert_same_after_growth(online: dict[int, float], offline: dict[int, float], first: int = GROW_AT + 1) -> None:
    after = list(range(first, ITERATIONS + 1))
    assert [i for i in online if i >= first] == [i for i in offline if i >= first] == after, (online, offline)
    errors = {i: abs(online[i] - offline[i]) / abs(offline[i]) for i in after}
    assert max(errors.values()) <= RELATIVE_TOLERANCE, errors


@pytest.fixture(scope="module")
def data_parallel_run(demo_data, tmp_path_factory) -> Path:
    """The online run on tests/tiny.yml's layout (2 data-parallel ranks, ZeRO-1), saving one checkpoint after the
    growth too."""
    run_dir = tmp_path_factory.mktemp("online") / "dp2_zero1"
    grow_online(demo_data, run_dir, 2, f"extra_save_iters=[{GROW_AT + 2}]")
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_online_growth_equals_the_grow_tool_and_a_resume(layout, demo_data, data_parallel_run, tmp_path):
    online = data_parallel_run if layout == "dp2_zero1" else tmp_path / "online"
    if layout != "dp2_zero1":
        grow_online(demo_data, online, 2, *LAYOUTS[layout])
    losses = train_losses(online)
    assert_same_after_growth(losses, grow_offline(demo_data, online, tmp_path / "offline", 2, *LAYOUTS[layout]))
    assert sorted(losses) == list(range(1, ITERATIONS + 1))

    growths = [r for r in read_metrics(online / "logs") if r["split"] == "growth"]
    assert [(g["iteration"], g["slot_counts"]) for g in growths] == [
        (GROW_AT, {"qkv_slot_num": 128, "proj_slot_num": 64, "ffn_slot_num": 512})]
    assert (growths[0]["growth_mode"], growths[0]["growth_optimizer"]) == ("preserve", "carry")
    before, after = (json.loads((online / "checkpoints" / f"global_step{i}" / "config.json").read_text())
                     for i in (GROW_AT, ITERATIONS))
    assert (before["ffn_slot_num"], after["ffn_slot_num"], after["proj_slot_num"]) == (256, 512, 64)
    record = json.loads((online / "checkpoints" / f"global_step{ITERATIONS}" / "growth.json").read_text())
    assert record["grown_from"] == {"qkv_slot_num": 64, "proj_slot_num": 64, "ffn_slot_num": 256}
    assert record["iteration"] == GROW_AT


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_each_growth_mode_and_optimizer_choice_equals_the_offline_path(mode, demo_data, tmp_path):
    online = grow_online(demo_data, tmp_path / "online", 1, *MODES[mode])
    offline = grow_offline(demo_data, tmp_path / "online", tmp_path / "offline", 1, *MODES[mode])
    assert_same_after_growth(online, offline)
    growth = next(r for r in read_metrics(tmp_path / "online" / "logs") if r["split"] == "growth")
    expected = {"official": ("official", "reset", "new"), "official_carried": ("official", "carry", "new"),
                "preserve_reset": ("preserve", "reset", "old")}.get(mode, ("preserve", "carry", "old"))
    assert (growth["growth_mode"], growth["growth_optimizer"], growth["growth_norm_token_count"]) == expected


@pytest.mark.slow
@pytest.mark.parametrize("resumed_at", [GROW_AT, GROW_AT + 2])
def test_a_resume_at_or_after_the_growth_continues_the_same_losses(resumed_at, demo_data, data_parallel_run,
                                                                   tmp_path):
    """At the growth's own checkpoint (the model before it: what a kill during the growth leaves) the resumed run
    grows again; after it, the resumed run builds the grown model from the schedule."""
    run_dir = tmp_path / "resumed"
    (run_dir / "checkpoints").mkdir(parents=True)
    tag = f"global_step{resumed_at}"
    shutil.copytree(data_parallel_run / "checkpoints" / tag, run_dir / "checkpoints" / tag)
    (run_dir / "checkpoints" / "latest").write_text(tag)
    shutil.copytree(data_parallel_run / "logs", run_dir / "logs")
    run_on_ranks(2, train, overrides(demo_data, run_dir, SCHEDULE))
    assert_same_after_growth(train_losses(run_dir), train_losses(data_parallel_run), first=resumed_at + 1)
    growths = [r["iteration"] for r in read_metrics(run_dir / "logs") if r["split"] == "growth"]
    assert growths == [GROW_AT], growths  # once: the resumed run's where it grew again


@pytest.mark.slow
def test_the_runs_own_config_loads_a_checkpoint_saved_after_the_growth(demo_data, data_parallel_run):
    """generate.py and eval.py pass the run's config beside the checkpoint: its schedule explains the counts."""
    from megatron.inference.loading import load_model

    config = load_config([TINY], overrides(demo_data, data_parallel_run, SCHEDULE), world_size=1)
    model = load_model(data_parallel_run / "checkpoints", config)
    assert (model.args.qkv_slot_num, model.args.ffn_slot_num) == (128, 512)
    unscheduled = load_config([TINY], overrides(demo_data, data_parallel_run), world_size=1)
    with pytest.raises(InputError, match="ffn_slot_num: saved 512, given 256"):
        load_model(data_parallel_run / "checkpoints", unscheduled)


def schedule_error(*extra: str) -> str:
    with pytest.raises(ConfigError) as error:
        load_config([TINY], ["save=/tmp/checkpoints", *extra], world_size=2)
    return str(error.value)


@pytest.mark.parametrize("extra, expected", [
    (["growth_schedule=[{iteration: 40, ffn_slot_num: 512}]"], "entry 1: iteration 40 is not before train_iters 40"),
    (["growth_schedule=[{iteration: 10, ffn_slot_num: 512}, {iteration: 10, ffn_slot_num: 1024}]"],
     "entry 2: iteration 10 does not come after the previous entry's 10"),
    (["growth_schedule=[{iteration: 10, ffn_slot_num: 128}]"], "entry 1 shrinks the model (ffn_slot_num 256 -> 128)"),
    (["growth_schedule=[{iteration: 10, ffn_slot_num: 511}]", "model_parallel_size=2"],
     "ffn_slot_num 511 is not divisible by model_parallel_size 2"),
    (["growth_schedule=[{iteration: 10, ffn_slot_num: 512}]", "model_type=transformer"],
     "model_type transformer has none"),
    (["growth_schedule=[{iteration: 10, ffn_slot_num: 512}]", "norm_activation_type=softmax"],
     "growth_mode preserve: norm_activation_type softmax cannot grow"),
    (["growth_schedule=[{iteration: 10, ffn_slot_num: 256}]"], "entry 1 grows nothing"),
    (["growth_schedule=[{iteration: 10, ffn_slots: 512}]"], "entry 1: unknown key 'ffn_slots'"),
    (["growth_schedule=[{ffn_slot_num: 512}]"], "entry 1: iteration None must be a positive integer"),
    (["growth_schedule=[{iteration: 10}]"], "entry 1 names no slot count"),
    (["growth_schedule=[{iteration: 10, ffn_slot_num: 512}]", "freeze_old_param_tokens=true"],
     "with freeze_old_param_tokens is not supported"),
])
def test_a_schedule_that_cannot_run_is_refused_in_one_line(extra, expected):
    message = schedule_error(*extra)
    assert expected in message and "\n" not in message, message


def test_a_schedule_needs_somewhere_to_save():
    with pytest.raises(ConfigError, match="growth_schedule saves the model before each growth.*set save"):
        load_config([TINY], ["growth_schedule=[{iteration: 10, ffn_slot_num: 512}]"], world_size=2)

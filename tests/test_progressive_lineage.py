"""tools/progressive_scaling.py pins each stage when it starts (work_dir/NAME/lineage.json): a re-run that finds the
shared config files or the plan changed for a started stage refuses, naming the key and both values, or with
--redo-changed redoes that stage and those after it, grown and scored anew; a SLURM chain's step jobs and
training jobs, which re-read the plan, refuse a plan changed since the submission (megatron/progressive/lineage*.py,
tools/slurm/train.sbatch)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron.checkpoint.growth_record import read_growth_record, write_growth_record
from megatron.checkpoint.manifest import checkpoint_files, content_digest, record_file, write_manifest
from megatron.progressive.lineage_check import changed_stage_lines, check_unchanged, prepare_stages
from megatron.progressive.local import clear_incomplete_growth
from megatron.progressive.plan import PlanError, read_plan
from megatron.progressive.progress import pending_steps, publish_final
from megatron.progressive.stage_config import resolve_plan
from tests.conftest import REPO
from tests.test_progressive_scaling import (
    DRIVER,
    GROWN,
    ONE_PROCESS,
    TINY,
    TOLERANCE,
    run_driver,
    stage_records,
    two_stages,
    write_plan,
)


def driver(plan: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DRIVER), str(plan), "--quiet", *options], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def finished(demo_data, tmp_path_factory) -> Path:
    """A two-stage plan run to its end (s1: 4 iterations, s2 grown from it: 6); its work_dir."""
    directory = tmp_path_factory.mktemp("pinned")
    run_driver(write_plan(directory, demo_data, two_stages(), **ONE_PROCESS))
    return directory / "work"


def copy_of(finished: Path, directory: Path, demo_data: Path, stages: list[dict], **shared: object) -> Path:
    """A plan over a copy of the finished work_dir, with `stages` and the shared keys `shared` (its own kept)."""
    shutil.copytree(finished, directory / "work", symlinks=True)
    return write_plan(directory, demo_data, stages, **{**ONE_PROCESS, **shared})


def lineage(work: Path, stage: str) -> dict:
    return json.loads((work / stage / "lineage.json").read_text())


@pytest.mark.slow
def test_each_stage_is_pinned_with_its_resolved_config_growth_mode_and_source(finished):
    first, second = lineage(finished, "s1"), lineage(finished, "s2")
    assert (first["grown_from"], first["growth_mode"]) == (None, None)
    assert (second["grown_from"], second["growth_mode"]) == ("s1@global_step4", "preserve")
    assert second["source_sha256"] == content_digest(finished / "s1" / "checkpoints" / "global_step4")
    assert first["source_sha256"] is None
    assert second["config"]["qkv_slot_num"] == GROWN["qkv_slot_num"] and second["config"]["weight_decay"] == 0.1
    assert second["config"]["train_iters"] == 6 and not {"save", "load", "log_dir"} & second["config"].keys()


@pytest.mark.slow
def test_a_shared_config_edit_refuses_started_stages_and_their_step_jobs(finished, demo_data, tmp_path):
    unchanged = copy_of(finished, tmp_path / "unchanged", demo_data, two_stages())
    os.unlink(tmp_path / "unchanged" / "work" / "final")
    published = driver(unchanged, "--step", "finish", "--stage", "s2")  # resolved as a SLURM job, not refused
    assert published.returncode == 0, published.stdout + published.stderr

    plan = copy_of(finished, tmp_path / "edited", demo_data, two_stages(), weight_decay=0.01)
    refused = driver(plan)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert (f"stage 's1' (stages[0]) was started from other settings than the plan and its config files give now "
            f"({tmp_path}/edited/work/s1/lineage.json): config.weight_decay: recorded 0.1, now 0.01. Restore them to "
            "continue the stage, or run again with --redo-changed to redo it and the stage(s) grown from it (s2): "
            f"their directories are moved to {tmp_path}/edited/work/replaced/") in refused.stderr
    assert not (tmp_path / "edited" / "work" / "replaced").exists()
    for view in ("--status", "--dry-run"):  # both say so, and change nothing; the dry run refuses as the run does
        shown = driver(plan, view)
        assert shown.returncode == (2 if view == "--dry-run" else 0), shown.stdout + shown.stderr
        if view == "--dry-run":  # the run's last line, its refusal (DeepSpeed's timestamped log lines before it)
            assert shown.stderr.splitlines()[-1] == refused.stderr.splitlines()[-1]
        for stage in ("s1", "s2"):
            assert (f"{stage}: changed since it was pinned: config.weight_decay: recorded 0.1, now 0.01 (a run "
                    f"refuses; --redo-changed redoes it and the stages after it)") in shown.stdout, (view, shown.stdout)
    assert lineage(tmp_path / "edited" / "work", "s1")["config"]["weight_decay"] == 0.1
    step = driver(plan, "--step", "finish", "--stage", "s2")
    assert step.returncode == 2 and ("stage 's1' (stages[0]): the plan or its config files changed since the stage "
                                     "was pinned") in step.stderr
    assert "config.weight_decay: recorded 0.1, now 0.01" in step.stderr


@pytest.mark.slow
def test_redo_changed_redoes_the_changed_stage_grown_and_scored_anew(finished, demo_data, tmp_path):
    plan = copy_of(finished, tmp_path, demo_data, two_stages(second_iters=8))
    work = tmp_path / "work"
    refused = driver(plan)
    assert refused.returncode == 2 and "stage 's2' (stages[1]) was started from other settings" in refused.stderr
    assert "config.train_iters: recorded 6, now 8" in refused.stderr and "(s2)" not in refused.stderr

    redone = run_driver(plan, "--redo-changed")
    assert f"s2: redone from scratch; its earlier directory is now {work}/replaced/s2-" in redone.stdout
    assert "s1: train" not in redone.stdout and "s2: grow s1's global_step4" in redone.stdout
    assert "s2: the grown checkpoint is scored at the start of its training launch" in redone.stdout
    assert "s2 grown from s1: validation loss" in redone.stdout
    (old,) = (work / "replaced").iterdir()
    assert (old / "checkpoints" / "latest").read_text().strip() == "global_step6"
    _, first_valid = stage_records(work, "s1")
    train, valid = stage_records(work, "s2")
    assert abs(valid[0] - first_valid[max(first_valid)]) <= TOLERANCE * abs(valid[0])  # the re-scored growth
    assert max(train) == 8 and (work / "final" / "latest").read_text().strip() == "global_step8"
    assert lineage(work, "s2")["config"]["train_iters"] == 8
    assert "nothing to do" in run_driver(plan).stdout


def test_a_step_job_refuses_a_plan_changed_since_the_submission(demo_data, tmp_path):
    plan_path = write_plan(tmp_path, demo_data, two_stages())
    plan = read_plan(plan_path)
    prepare_stages(plan, resolve_plan(plan, slurm=True))  # what --slurm pins before submitting the chain
    content = yaml.safe_load(plan_path.read_text())
    content["stages"][1]["ffn_slot_num"] = 1024
    plan_path.write_text(yaml.safe_dump(content))
    step = driver(plan_path, "--step", "grow", "--stage", "s2")
    assert step.returncode == 2, step.stdout + step.stderr
    assert ("stage 's2' (stages[1]): the plan or its config files changed since the stage was pinned "
            f"({tmp_path}/work/s2/lineage.json): config.ffn_slot_num: recorded 512, now 1024. Restore them, or run "
            "tools/progressive_scaling.py again (with --redo-changed to redo a stage that has started)") in step.stderr
    assert not (tmp_path / "work" / "s2" / "checkpoints").exists()


def test_a_config_file_edited_while_the_plan_runs_stops_the_next_step(demo_data, tmp_path):
    plan = read_plan(write_plan(tmp_path, demo_data, two_stages()))
    prepare_stages(plan, resolve_plan(plan))
    check_unchanged(plan, resolve_plan(plan), plan.stages)  # resolved afresh, nothing changed
    shared = plan.configs[-1]
    shared.write_text(yaml.safe_dump({**yaml.safe_load(shared.read_text()), "seed": 7}))
    with pytest.raises(PlanError) as error:
        check_unchanged(plan, resolve_plan(plan), plan.stages)
    assert "stage 's1' (stages[0]): the plan or its config files changed" in str(error.value)
    assert "config.seed: recorded 1234, now 7" in str(error.value)


def test_a_chain_training_job_checks_the_lineage_before_it_trains(demo_data, tmp_path):
    """train.sbatch as the chain submits it (PROGRESSIVE_PLAN, PROGRESSIVE_STAGE): on the pinned plan the check
    passes and the script goes on (here, outside SLURM, to its next line's refusal); after a shared config file was
    edited, it stops first, naming the key, and nothing trains."""
    plan_path = write_plan(tmp_path, demo_data, two_stages())
    plan = read_plan(plan_path)
    prepare_stages(plan, resolve_plan(plan, slurm=True))
    environment = {**os.environ, "PROGRESSIVE_PLAN": str(plan_path), "PROGRESSIVE_STAGE": "s1",
                   "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    environment.pop("SLURM_NTASKS_PER_NODE", None)

    def job() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "tools/slurm/train.sbatch", *map(str, plan.config_files(plan.stages[0]))],
                              cwd=REPO, env=environment, capture_output=True, text=True, timeout=300)

    pinned = job()
    assert "s1: the plan and its config files are as pinned" in pinned.stdout, pinned.stdout + pinned.stderr
    assert "submit with --ntasks-per-node" in pinned.stderr
    shared = plan.configs[-1]
    shared.write_text(yaml.safe_dump({**yaml.safe_load(shared.read_text()), "seed": 7}))
    edited = job()
    assert edited.returncode == 2, edited.stdout + edited.stderr
    assert "config.seed: recorded 1234, now 7" in edited.stderr and "ntasks-per-node" not in edited.stderr
    assert not (tmp_path / "work" / "s1" / "checkpoints").exists()


# --- a lineage that cannot be skipped: checkpoints written here, nothing trained ---

def committed(checkpoints: Path, step: int, weights: bytes, source_sha256: str | None = None) -> Path:
    """A committed checkpoint of `weights` (with its manifest) as the newest of `checkpoints`; `source_sha256`: the
    digest of the checkpoint it was grown from, pinned in its growth record as the grow tool pins it."""
    tag = checkpoints / f"global_step{step}"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(weights)
    if source_sha256:
        write_growth_record(tag, {"format": 1, "grown_from": {"qkv_slot_num": 64, "proj_slot_num": 64,
                                                              "ffn_slot_num": 256}, "source_sha256": source_sha256})
    write_manifest(tag, [record for name in checkpoint_files(tag) for record in record_file(tag, name)])
    (checkpoints / "latest").write_text(tag.name)
    return tag


def grown_plan(demo_data: Path, tmp_path: Path):
    """s1 trained (its final checkpoint, global_step4), s2 grown from it (global_step0, the source's digest pinned
    in it), both pinned."""
    plan = read_plan(write_plan(tmp_path, demo_data, two_stages()))
    prepare_stages(plan, resolve_plan(plan))  # both pinned before anything runs
    source = committed(plan.checkpoints(plan.stages[0]), 4, b"s1 weights")
    prepare_stages(plan, resolve_plan(plan))  # s2 pinned again before it grows, s1 held to its lineage
    committed(plan.checkpoints(plan.stages[1]), 0, b"s2 grown", content_digest(source))
    return plan


def test_a_finished_predecessor_deleted_after_the_growth_neither_blocks_nor_is_redone(demo_data, tmp_path):
    """Deleting s1's checkpoints once s2 grew (to save quota): s2 is not changed, continues (scored, trained), is not
    redone by --redo-changed, and a chain's check job passes; s1 is not retrained."""
    plan = grown_plan(demo_data, tmp_path)
    shutil.rmtree(plan.checkpoints(plan.stages[0]))
    resolved = resolve_plan(plan)
    assert changed_stage_lines(plan, resolved) == []
    assert prepare_stages(plan, resolved, redo=True) == []
    assert (tmp_path / "work" / "s2" / "checkpoints" / "global_step0").is_dir()
    check_unchanged(plan, resolve_plan(plan), plan.stages)
    assert [(step.kind, step.stage.name) for step in pending_steps(plan, resolved)] == [
        ("evaluate", "s2"), ("train", "s2"), ("finish", "s2")]
    (tmp_path / "work" / "s2" / "lineage.json").unlink()  # pinned anew from the digest s2's checkpoint carries
    assert prepare_stages(plan, resolve_plan(plan), adopt=True)[0].startswith("s2: pinned as the plan")
    assert lineage(tmp_path / "work", "s2")["source_sha256"] == read_growth_record(
        tmp_path / "work" / "s2" / "checkpoints" / "global_step0")["source_sha256"]


def completed(plan) -> None:
    """grown_plan's s2 trained to its end and work_dir/final published: a plan a run finds complete."""
    committed(plan.checkpoints(plan.stages[1]), 6, b"s2 trained")
    publish_final(plan)


def test_a_dry_run_refuses_a_changed_plan_as_the_run_does(demo_data, tmp_path, capsys):
    """After an edit to a complete plan the dry run ended "nothing to do: the plan is complete" with rc 0, where the
    run refuses with rc 2: it now makes the run's checks and gives its verdict, with its message."""
    from tools.progressive_scaling import main

    plan = grown_plan(demo_data, tmp_path)
    completed(plan)
    assert main([str(plan.path), "--dry-run"]) == 0
    assert "nothing to do: the plan is complete" in capsys.readouterr().out
    shared = plan.configs[-1]
    shared.write_text(yaml.safe_dump({**yaml.safe_load(shared.read_text()), "weight_decay": 0.01}))
    with pytest.raises(PlanError) as refused:
        prepare_stages(plan, resolve_plan(plan))
    assert main([str(plan.path), "--dry-run"]) == 2
    printed = capsys.readouterr()
    assert printed.err == f"progressive_scaling.py: error: {refused.value}\n"
    assert "s1: changed since it was pinned: config.weight_decay: recorded 0.1, now 0.01" in printed.out
    assert "nothing to do" not in printed.out

    (tmp_path / "work" / "s1" / "lineage.json").unlink()
    with pytest.raises(PlanError) as refused:
        prepare_stages(plan, resolve_plan(plan), adopt=True)  # s1 adoptable, s2 still changed
    assert main([str(plan.path), "--dry-run", "--adopt-unpinned"]) == 2
    assert capsys.readouterr().err == f"progressive_scaling.py: error: {refused.value}\n"
    assert not (tmp_path / "work" / "s1" / "lineage.json").exists()  # the refusal came before any adoption


def test_status_calls_a_predecessor_deleted_after_the_growth_done_as_the_run_does(demo_data, tmp_path, capsys):
    """--status called s1 "not started" once its checkpoints were deleted after s2 grew from them, while the run
    counts it done and does not retrain it."""
    from tools.progressive_scaling import main

    plan = grown_plan(demo_data, tmp_path)
    shutil.rmtree(plan.checkpoints(plan.stages[0]))
    assert [(step.kind, step.stage.name) for step in pending_steps(plan, resolve_plan(plan))] == [
        ("evaluate", "s2"), ("train", "s2"), ("finish", "s2")]
    assert main([str(plan.path), "--status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "s1  done: iteration 4/4 (its final checkpoint deleted after s2 grew from it)"
    assert lines[1] == "s2  grown, not trained yet: iteration 0/6"


def test_a_dry_run_with_redo_changed_lists_the_stages_it_would_redo_and_their_steps(demo_data, tmp_path, capsys):
    from tools.progressive_scaling import main

    plan = grown_plan(demo_data, tmp_path)
    shared = plan.configs[-1]
    shared.write_text(yaml.safe_dump({**yaml.safe_load(shared.read_text()), "weight_decay": 0.01}))
    assert main([str(plan.path), "--dry-run", "--redo-changed"]) == 0
    out = capsys.readouterr().out
    assert f"with --redo-changed: s1, s2 redone from scratch (their directories moved to {tmp_path}/work/replaced/)" \
        in out
    steps = [line.split(":")[0].strip() for line in out.splitlines() if line.startswith("  s")]
    assert steps == ["s1 train", "s2 grow", "s2 evaluate", "s2 train", "s2 finish"]
    assert not (tmp_path / "work" / "replaced").exists()  # nothing done


def test_a_changed_default_is_named_as_one_with_the_setting_that_keeps_it(demo_data, tmp_path):
    """A stage whose lineage records a default other than today's (growth_mode preserve; the default is official),
    resumed with no growth_mode in the plan: the refusal says the default changed and how to keep the recorded
    value."""
    plan = grown_plan(demo_data, tmp_path)
    untouched = tmp_path / "tiny_without_growth_mode.yml"
    untouched.write_text("".join(line for line in TINY.read_text().splitlines(keepends=True)
                                 if not line.startswith("growth_mode")))
    content = yaml.safe_load(plan.path.read_text())
    plan.path.write_text(yaml.safe_dump({**content, "configs": [str(untouched), *content["configs"][1:]]}))
    plan = read_plan(plan.path)
    with pytest.raises(PlanError) as refused:
        prepare_stages(plan, resolve_plan(plan))
    assert ("growth_mode: recorded 'preserve', now 'official' (no config file of the plan and not the stage sets "
            "growth_mode: its default changed since the stage started; set growth_mode: \"preserve\" in the plan to "
            "continue as started)") in str(refused.value)
    assert "config.weight_decay" not in str(refused.value)


def test_a_started_stage_without_a_lineage_is_refused_until_adopted(demo_data, tmp_path):
    plan = grown_plan(demo_data, tmp_path)
    (tmp_path / "work" / "s1" / "lineage.json").unlink()  # a driver that wrote none, or the file deleted
    with pytest.raises(PlanError) as refused:
        prepare_stages(plan, resolve_plan(plan))
    assert (
        f"stage 's1' (stages[0]) has started but is not pinned: it has no {tmp_path}/work/s1/lineage.json (started "
        "by an older driver, or the file deleted), so nothing shows it was started from the plan as it is now. Run "
        "again with --adopt-unpinned to pin it as the plan gives it now, or with --redo-changed to redo it and the "
        "stage(s) grown from it (s2)") in str(refused.value)
    assert not (tmp_path / "work" / "s1" / "lineage.json").exists()
    assert changed_stage_lines(plan, resolve_plan(plan)) == [
        f"s1: started but not pinned: it has no {tmp_path}/work/s1/lineage.json (started by an older driver, or the "
        "file deleted) (a run refuses; --adopt-unpinned pins it as the plan gives it now, --redo-changed redoes it and "
        "the stages after it)"]
    with pytest.raises(PlanError, match=r"stage 's1' \(stages\[0\]\) is not pinned: .*/s1/lineage.json is gone"):
        check_unchanged(plan, resolve_plan(plan), plan.stages)  # a chain's job, after the file went
    said = prepare_stages(plan, resolve_plan(plan), adopt=True)
    assert said == [f"s1: pinned as the plan and its config files give it now (--adopt-unpinned); it has no "
                    f"{tmp_path}/work/s1/lineage.json (started by an older driver, or the file deleted)"]
    assert lineage(tmp_path / "work", "s1")["config"]["weight_decay"] == 0.1
    assert prepare_stages(plan, resolve_plan(plan)) == []


def test_redo_changed_redoes_a_started_stage_that_is_not_pinned(demo_data, tmp_path):
    plan = grown_plan(demo_data, tmp_path)
    (tmp_path / "work" / "s2" / "lineage.json").unlink()
    said = prepare_stages(plan, resolve_plan(plan), redo=True)
    assert len(said) == 1 and said[0].startswith(f"s2: redone from scratch; its earlier directory is now "
                                                 f"{tmp_path}/work/replaced/s2-")
    assert not (tmp_path / "work" / "s2" / "checkpoints").exists()
    assert lineage(tmp_path / "work", "s2")["source_sha256"] == content_digest(
        tmp_path / "work" / "s1" / "checkpoints" / "global_step4")


def test_a_predecessor_retrained_under_the_same_tag_refuses_the_stage_grown_from_it(demo_data, tmp_path):
    plan = grown_plan(demo_data, tmp_path)
    source = tmp_path / "work" / "s1" / "checkpoints"
    shutil.rmtree(source)
    committed(source, 4, b"s1 weights, retrained by hand")  # same tag, other weights
    with pytest.raises(PlanError) as refused:
        prepare_stages(plan, resolve_plan(plan))
    assert "stage 's2' (stages[1]) was started from other settings than the plan and its config files give now" \
        in str(refused.value)
    assert "source_sha256: recorded '" in str(refused.value)


def test_a_stage_whose_checkpoints_all_fail_is_still_held_to_its_lineage(demo_data, tmp_path):
    plan = grown_plan(demo_data, tmp_path)
    for stage in ("s1", "s2"):  # every checkpoint damaged: neither can be resumed, both have started
        weights = tmp_path / "work" / stage / "checkpoints" / f"global_step{4 if stage == 's1' else 0}"
        os.truncate(weights / "mp_rank_00_model_states.pt", 3)
    shared = plan.configs[-1]
    shared.write_text(yaml.safe_dump({**yaml.safe_load(shared.read_text()), "weight_decay": 0.01}))
    with pytest.raises(PlanError, match="config.weight_decay: recorded 0.1, now 0.01"):
        prepare_stages(plan, resolve_plan(plan))
    assert lineage(tmp_path / "work", "s1")["config"]["weight_decay"] == 0.1  # not pinned anew
    with pytest.raises(PlanError, match=r"stage 's2' \(stages\[1\]\) has checkpoints in .* but none can be used"):
        clear_incomplete_growth(plan, plan.stages[1])  # the growth is not redone over them
    assert (tmp_path / "work" / "s2" / "checkpoints" / "global_step0").is_dir()

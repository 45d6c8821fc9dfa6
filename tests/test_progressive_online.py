"""tools/progressive_scaling.py --online: a plan whose stages only grow runs as one job that grows at each stage's
end (growth_schedule), with the chain's lineage records; plans that cannot run so are refused before launch,
naming the stage and the reason. As one SLURM job: tests/test_progressive_scaling.py, beside the chain's jobs.

Plans use tests/tiny.yml on the small demo corpus, a few iterations per stage.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from megatron.checkpoint.manifest import content_digest
from megatron.progressive.plan import PlanError, read_plan
from megatron.progressive.stage_config import job_settings, resolve_plan
from tests.conftest import REPO, read_metrics
from tests.test_progressive_scaling import DRIVER, ONE_PROCESS, resolve_with_demo_data, saved_config, write_plan

S2 = {"qkv_slot_num": 96, "proj_slot_num": 96, "ffn_slot_num": 384}
S3 = {"qkv_slot_num": 128, "proj_slot_num": 128, "ffn_slot_num": 512}


def three_stages() -> list[dict]:
    return [{"name": "s1", "train_iters": 4, "eval_interval": 2},
            {"name": "s2", **S2, "train_iters": 8}, {"name": "s3", **S3, "train_iters": 12}]


def online_refusal(path) -> str:
    with pytest.raises(PlanError) as error:
        resolve_plan(read_plan(path, online=True))
    return str(error.value)


# --- refused before anything runs ---


@pytest.mark.parametrize("change, expected", [
    ({1: {"train_iters": 3}}, "stage 's2' (stages[1]): train_iters 3 is not after stage 's1''s 4 (a restarted "
                              "iteration)"),
    ({1: {"data_path": "other_text_document"}}, "stage 's2' (stages[1]): key 'data_path' cannot change between the "
                                                "stages of an online plan (another dataset"),
    ({2: {"warmup": 0.1}}, "stage 's3' (stages[2]): key 'warmup' cannot change between the stages of an online plan "
                           "(a setting of the whole job"),
    ({1: {"growth_mode": "official"}}, "key 'growth_mode' differs between the grown stages (s2 'official', s3 None)"),
    ({2: {"train_iters": None}}, "stage 's3' (stages[2]) sets no train_iters"),
    ({2: S2}, "stage 's3' (stages[2]) has the parameter-token counts of stage 's2', so the online job would not grow"),
])
def test_a_plan_that_cannot_run_as_one_job_is_refused_naming_the_stage_and_why(demo_data, tmp_path, change,
                                                                                expected):
    stages = three_stages()
    for index, keys in change.items():
        stages[index] = {key: value for key, value in {**stages[index], **keys}.items() if value is not None}
    message = online_refusal(write_plan(tmp_path, demo_data, stages))
    assert "it cannot run --online" in message or "online job would not grow" in message, message
    assert expected in message, message
    assert not (tmp_path / "work").exists()


def test_a_decay_length_the_shared_configs_fix_must_be_the_jobs(demo_data, tmp_path):
    message = online_refusal(write_plan(tmp_path, demo_data, three_stages(), lr_decay_iters=4))
    assert "key 'lr_decay_iters' is 4 (from the shared configs) but the online job trains until iteration 12" \
        in message, message


def test_the_job_starts_at_the_first_stage_and_grows_at_each_stage_end_on_one_schedule(demo_data, tmp_path):
    stages = three_stages()
    stages[1]["growth_optimizer"] = stages[2]["growth_optimizer"] = "reset"
    plan = read_plan(write_plan(tmp_path, demo_data, stages), online=True)
    resolved = resolve_plan(plan)
    settings = job_settings(plan, resolved)
    assert (settings["qkv_slot_num"], settings["proj_slot_num"], settings["ffn_slot_num"]) == (64, 64, 256)
    assert settings["growth_schedule"] == [{"iteration": 4, **S2}, {"iteration": 8, **S3}]
    assert (settings["train_iters"], settings["lr_decay_iters"], settings["eval_interval"]) == (12, 12, 2)
    assert settings["growth_optimizer"] == "reset"  # a grown stage's growth key is the job's
    assert [entry.steps for entry in resolved] == [4, 4, 4]
    assert resolved[0].config.growth_optimizer is None  # the first stage is not grown
    assert settings["save"] == str(tmp_path / "work" / "job" / "checkpoints")


def test_the_online_demo_plan_is_valid_given_its_data(demo_data, tmp_path):
    """configs/progressive/demo_online.yml: the demo model grown twice in one job of 300 iterations."""
    stages = resolve_with_demo_data("demo_online.yml", demo_data, tmp_path, online=True)
    assert [entry.slots for entry in stages] == ["128/128/512", "192/192/768", "256/256/1024"]
    assert [entry.steps for entry in stages] == [100, 100, 100]
    assert all(entry.config.lr_decay_iters == 300 for entry in stages)


def test_a_chain_plan_runs_without_online_as_before(demo_data, tmp_path):
    """The same file as a chain: train_iters 8 and 12 are the stages' own lengths there."""
    plan = read_plan(write_plan(tmp_path, demo_data, three_stages()))
    assert [entry.steps for entry in resolve_plan(plan)] == [4, 8, 12]


# --- end to end, locally ---


def driver(plan, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DRIVER), str(plan), "--online", "--quiet", *options], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_an_online_plan_runs_as_one_job_that_grows_continues_after_a_stop_and_is_pinned(demo_data, tmp_path):
    plan = write_plan(tmp_path, demo_data, three_stages(), checkpoint_factor=5, exit_interval=6, **ONE_PROCESS)
    work = tmp_path / "work"
    stopped = driver(plan)
    assert stopped.returncode == 2, stopped.stderr
    assert "the online job: training stopped at iteration 6 of 12" in stopped.stderr, stopped.stderr
    assert "job: train iterations 1-12, growing at 4 into s2, growing at 8 into s3" in stopped.stdout
    status = subprocess.run([sys.executable, str(DRIVER), str(plan), "--online", "--status"], cwd=REPO,
                            capture_output=True, text=True).stdout
    assert re.search(r"s1\s+done: iteration 4/4", status) and re.search(r"s2\s+training: iteration 6/8", status)
    assert re.search(r"s3\s+not grown yet", status), status

    shared = plan.parent / "shared.yml"
    shared.write_text(shared.read_text().replace("exit_interval: 6", "exit_interval: null"))  # not a pinned key
    finished = driver(plan)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "job: train iterations 7-12, growing at 8 into s3" in finished.stdout
    growths = [record for record in read_metrics(work / "job" / "logs") if record["split"] == "growth"]
    assert [(record["iteration"], record["slot_counts"]) for record in growths] == [(4, S2), (8, S3)]
    train = {record["iteration"] for record in read_metrics(work / "job" / "logs") if record["split"] == "train"}
    assert train == set(range(1, 13))  # the iterations continue, each once
    assert os.readlink(work / "final") == "job/checkpoints"
    final = saved_config(work / "final")
    assert (final.qkv_slot_num, final.proj_slot_num, final.ffn_slot_num, final.train_iters) == (128, 128, 512, 12)

    for stage, source in (("s2", "global_step4"), ("s3", "global_step8")):
        lineage = json.loads((work / stage / "lineage.json").read_text())
        assert lineage["grown_from"] == f"{'s1' if stage == 's2' else 's2'}@{source}"
        assert lineage["source_sha256"] == content_digest(work / "job" / "checkpoints" / source)
        assert lineage["config"]["ffn_slot_num"] == (S2 if stage == "s2" else S3)["ffn_slot_num"]
    assert "nothing to do: the plan is complete" in driver(plan).stdout

    chain = subprocess.run([sys.executable, str(DRIVER), str(plan), "--quiet"], cwd=REPO, capture_output=True,
                           text=True)
    assert chain.returncode == 2 and "holds an online job" in chain.stderr and "continue it with --online" \
        in chain.stderr
    edited = yaml.safe_load(plan.read_text())
    edited["stages"][2]["ffn_slot_num"] = 768
    plan.write_text(yaml.safe_dump(edited))
    refused = driver(plan, "--redo-changed")
    assert refused.returncode == 2, refused.stderr
    assert "stage 's3' (stages[2]) was started from other settings" in refused.stderr
    assert "config.ffn_slot_num: recorded 512, now 768" in refused.stderr
    assert "cannot redo part of an online plan" in refused.stderr

"""tools/progressive_scaling.py: plans refused before anything runs, --dry-run, a two-stage plan end to end, a
driver killed with SIGKILL mid-stage and run again, and the same plan as a job chain on a real single-node SLURM.

Plans use tests/tiny.yml (2 processes) on the small demo corpus, with a few iterations per stage.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron.checkpoint.manifest import content_digest
from megatron.config import Config
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.parameter_count import count_parameters_by_component
from megatron.progressive.plan import PlanError, read_plan
from megatron.progressive.progress import pending_steps
from megatron.progressive.stage_config import resolve_plan
from tests.conftest import REPO, read_metrics
from tests.distributed import free_port
from tests.test_slurm import FINAL_STATES, slurm, submit_env  # noqa: F401 - the module-scoped SLURM fixtures

TINY = REPO / "tests" / "tiny.yml"
DRIVER = REPO / "tools" / "progressive_scaling.py"
GROWN = {"qkv_slot_num": 128, "proj_slot_num": 128, "ffn_slot_num": 512}
TOLERANCE = 1e-5  # relative: growth_mode preserve keeps the validation loss up to rounding


def shared_config(directory: Path, demo_data: Path, **extra: object) -> Path:
    """The keys every stage shares beyond tests/tiny.yml: data, a free port, each stage's own decay length."""
    path = directory / "shared.yml"
    path.write_text(yaml.safe_dump({"data_path": f"{demo_data}/demo_text_document",
                                    "vocab_file": f"{demo_data}/tokenizer.json", "lr_decay_iters": None,
                                    "master_port": free_port(), **extra}), encoding="utf-8")
    return path


# tiny.yml's global batch of 16 on one process: the driver's local runs test the plan, not data parallelism (the
# SLURM chain keeps two tasks), and take half the CPU.
ONE_PROCESS = {"num_gpus": 1, "gradient_accumulation_steps": 4}


def write_plan(directory: Path, demo_data: Path, stages: list[dict], **shared: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "plan.yml"
    path.write_text(yaml.safe_dump({"configs": [str(TINY), str(shared_config(directory, demo_data, **shared))],
                                    "work_dir": str(directory / "work"), "stages": stages}), encoding="utf-8")
    return path


def two_stages(second_iters: int = 6) -> list[dict]:
    return [{"name": "s1", "train_iters": 4, "eval_interval": 2},
            {"name": "s2", **GROWN, "train_iters": second_iters, "eval_interval": 2, "warmup": 0.25}]


def refusal(path: Path) -> str:
    with pytest.raises(PlanError) as error:
        resolve_plan(read_plan(path))
    assert not (path.parent / "work").exists()  # refused before anything ran
    return str(error.value)


# --- plans refused before anything runs ---


def test_shrinking_slots_are_refused_naming_stage_key_and_fix(demo_data, tmp_path):
    stages = two_stages()
    stages[1]["ffn_slot_num"] = 128
    message = refusal(write_plan(tmp_path, demo_data, stages))
    assert message.startswith(f"{tmp_path / 'plan.yml'}: stage 's2' (stages[1]): key 'ffn_slot_num' is 128")
    assert "stage 's1''s 256" in message and "set ffn_slot_num: 256 or more" in message


def test_a_width_change_between_stages_is_refused(demo_data, tmp_path):
    stages = two_stages()
    stages[1]["hidden_size"] = 128
    message = refusal(write_plan(tmp_path, demo_data, stages))
    assert "stage 's2' (stages[1]) cannot be grown from stage 's1'" in message
    assert "hidden_size (source 64, target 128)" in message
    assert "Only qkv_slot_num, proj_slot_num, ffn_slot_num and the parallel layout may change" in message


def test_an_unknown_key_in_a_stage_is_refused_with_the_closest_key(demo_data, tmp_path):
    stages = two_stages()
    stages[1]["qkv_slots"] = 128
    message = refusal(write_plan(tmp_path, demo_data, stages))
    assert message == (f"{tmp_path / 'plan.yml'}: stage 's2' (stages[1]): key 'qkv_slots' is not a config key; "
                       "did you mean 'qkv_slot_num'?")


def test_a_stage_config_deepy_would_refuse_is_refused(demo_data, tmp_path):
    stages = two_stages()
    stages[1]["model_parallel_size"] = 3
    message = refusal(write_plan(tmp_path, demo_data, stages))
    assert "stage 's2' (stages[1]): its config" in message and "as deepy.py would refuse it" in message
    assert "model_parallel_size 3 does not divide" in message and "choose a model_parallel_size" in message


def test_a_decay_length_inherited_from_the_shared_configs_is_refused(demo_data, tmp_path):
    path = write_plan(tmp_path, demo_data, two_stages())
    shared = tmp_path / "shared.yml"
    shared.write_text(shared.read_text().replace("lr_decay_iters: null", "lr_decay_iters: 40"))
    message = refusal(path)
    assert "stage 's1' (stages[0]): key 'lr_decay_iters' is 40" in message
    assert "set lr_decay_iters: 4 in the stage" in message


def test_a_stage_value_its_key_refuses_is_named_as_the_plan_writes_it(demo_data, tmp_path):
    stages = two_stages()
    stages[1]["weight_decay"] = float("nan")  # `weight_decay: .nan` in the plan
    message = refusal(write_plan(tmp_path, demo_data, stages))
    assert message.startswith(f"{tmp_path / 'plan.yml'}: stage 's2' (stages[1]): weight_decay: nan is not a finite "
                              "number") and "override" not in message


def test_what_the_real_run_would_hit_is_refused_by_the_dry_run_too(demo_data, tmp_path, capsys):
    """A √n ramp in the first stage (never grown: its launch would refuse it) and a work_dir under a regular file
    (the run's first mkdir fails)."""
    from tools.progressive_scaling import main

    stages = two_stages()
    stages[0]["norm_token_count_ramp_iters"] = 2
    assert main([str(write_plan(tmp_path / "ramp", demo_data, stages)), "--dry-run"]) == 2
    assert ("stage 's1' (stages[0]): key 'norm_token_count_ramp_iters': the first stage trains from scratch and is not "
            "grown, so it has no n of √n to ramp from; set it in the stages that are grown") in capsys.readouterr().err
    path = write_plan(tmp_path / "file", demo_data, two_stages())
    (tmp_path / "file" / "work").write_text("")
    content = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**content, "work_dir": str(tmp_path / "file" / "work" / "runs")}))
    assert main([str(path), "--dry-run"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (f"progressive_scaling.py: error: {path}: work_dir {tmp_path}/file/work/runs cannot be a "
                     f"directory: {tmp_path}/file/work is a file; choose another work_dir")


@pytest.mark.parametrize("content, expected", [
    ({"configs": [str(TINY)], "work_dir": "w", "stages": [{"name": "a", "train_iters": 2}], "stage": []},
     "unknown key(s) 'stage'; a plan has only configs, work_dir, stages"),
    ({"configs": [str(TINY)], "work_dir": "w", "stages": [{"name": "a"}, {"name": "a"}]},
     "stages[1]: name 'a' is used by an earlier stage"),
    ({"configs": [str(TINY)], "work_dir": "w", "stages": [{"name": "a", "save": "x"}]},
     "stage 'a' (stages[0]): key 'save' is set by the driver (work_dir/NAME/checkpoints)"),
    ({"configs": [str(TINY)], "work_dir": "w", "stages": [{"name": "a", "pretrain_partial_init": "x"}]},
     "key 'pretrain_partial_init' cannot be part of a plan: the driver grows each stage"),
    ({"configs": ["missing.yml"], "work_dir": "w", "stages": [{"name": "a"}]}, "configs: missing.yml does not exist"),
])
def test_malformed_plans_are_refused_with_one_named_error(tmp_path, content, expected):
    path = tmp_path / "plan.yml"
    path.write_text(yaml.safe_dump(content))
    with pytest.raises(PlanError, match=re.escape(expected)):
        read_plan(path)


def test_the_cli_reports_a_refused_plan_as_one_error_and_exit_2(demo_data, tmp_path, capsys):
    from tools.progressive_scaling import main

    stages = two_stages()
    stages[1]["ffn_slot_num"] = 128
    assert main([str(write_plan(tmp_path, demo_data, stages))]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("error:") == 1 and "key 'ffn_slot_num'" in error and not (tmp_path / "work").exists()


# --- dry run and the official recipe ---


def test_dry_run_prints_sizes_flops_and_every_command_and_runs_nothing(demo_data, tmp_path, capsys):
    from tools.progressive_scaling import main

    path = write_plan(tmp_path, demo_data, two_stages())
    assert main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\| s1 \| 64/64/256 \| [\d.]+M \([\d.]+M\) \| \d+% \| [\d.]+M \| 4 × 1,024 \|", out), out
    assert "| s2 | 128/128/512 |" in out and "Total training compute" in out
    steps = [line.split(":")[0].strip() for line in out.splitlines() if line.startswith("  s")]
    assert steps == ["s1 train", "s2 grow", "s2 evaluate", "s2 train", "s2 finish"]
    assert "--tag global_step4" in out and "--reset-iteration" in out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if line.startswith("  s")}
    assert "eval_at_start=true" in lines["s2 train"] and "eval_at_start" not in lines["s1 train"]  # scored first
    assert not (tmp_path / "work").exists()


def test_slurm_dry_run_is_a_chain_with_afterok_dependencies(demo_data, tmp_path, capsys):
    from tools.progressive_scaling import main

    assert main([str(write_plan(tmp_path, demo_data, two_stages())), "--dry-run", "--slurm",
                 "--sbatch-option=--gpus-per-node=0"]) == 0
    jobs = [line.strip() for line in capsys.readouterr().out.splitlines() if line.startswith("  s")]
    assert [job.split(":")[0] for job in jobs] == ["s1 train", "s2 grow", "s2 train", "s2 finish"]
    assert "--dependency" not in jobs[0] and "'--dependency=afterok:<job id of s1 train>'" in jobs[1]
    assert "'--dependency=afterok:<job id of s2 grow>'" in jobs[2] and "EVAL_BEFORE_TRAINING=1" in jobs[2]
    assert "PROGRESSIVE_STAGE=s1" in jobs[0] and "PROGRESSIVE_STAGE=s2" in jobs[2]  # the lineage check first
    assert f"PROGRESSIVE_PLAN={tmp_path / 'plan.yml'}" in jobs[0]
    assert "--ntasks-per-node=2 --gpus-per-node=2" in jobs[0] and jobs[0].index("--gpus-per-node=0") > jobs[0].index(
        "--gpus-per-node=2")  # the user's options come last: they override the driver's
    assert "tools/slurm/train.sbatch" in jobs[0] and "tools/slurm/progressive_step.sbatch" in jobs[1]


def resolve_with_demo_data(name: str, demo_data: Path, tmp_path: Path, online: bool = False) -> list:
    """configs/progressive/`name`'s stages resolved for SLURM (as one job: `online`), the demo corpus in place of
    its data."""
    recipe = yaml.safe_load((REPO / "configs" / "progressive" / name).read_text())
    data = tmp_path / "data.yml"
    data.write_text(yaml.safe_dump({"data_path": f"{demo_data}/demo_text_document",
                                    "vocab_file": f"{demo_data}/tokenizer.json"}))
    plan = tmp_path / "plan.yml"
    plan.write_text(yaml.safe_dump({**recipe, "configs": [str(REPO / c) for c in recipe["configs"]] + [str(data)],
                                    "work_dir": str(tmp_path / "work")}))
    return resolve_plan(read_plan(plan, online=online), slurm=True)


def test_the_official_recipe_plan_is_valid_given_its_data(demo_data, tmp_path):
    """configs/progressive/openwebtext2_354M_to_757M.yml on its cluster (16 then 64 GPUs), the demo corpus in
    place of OpenWebText2."""
    base, grown = resolve_with_demo_data("openwebtext2_354M_to_757M.yml", demo_data, tmp_path)
    assert (base.processes, grown.processes) == (16, 64)
    assert base.config.train_batch_size == grown.config.train_batch_size == 512
    assert grown.growth.summary() == ["qkv_slot_num 768 -> 1792", "proj_slot_num 768 -> 1792",
                                      "ffn_slot_num 3072 -> 7168"]
    assert (base.config.train_iters, grown.config.train_iters, grown.config.lr_decay_iters) == (600000, 60000, 60000)


def test_the_dense_757M_baseline_plan_is_valid_given_its_data(demo_data, tmp_path):
    """configs/progressive/openwebtext2_757M_transformer.yml (docs/paper_scale.md): the 757M Transformer from
    scratch on 64 GPUs with the recipe's batch and schedule, the demo corpus in place of OpenWebText2."""
    (stage,) = resolve_with_demo_data("openwebtext2_757M_transformer.yml", demo_data, tmp_path)
    config = stage.config
    assert stage.processes == 64 and config.train_batch_size == 512 and config.model_type == "transformer"
    args = TokenFormerArgs.from_config(config, padded_vocab_size=50304)
    assert abs(count_parameters_by_component(TokenFormerModel(args, device="meta"))["total_params"] / 757e6 - 1) < 0.01
    assert (config.train_iters, config.lr_decay_iters) == (600000, 600000)


# --- end to end, locally ---


def run_driver(plan: Path, *options: str, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(DRIVER), str(plan), "--quiet", *options], cwd=REPO,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def stage_records(work: Path, stage: str) -> tuple[dict[int, float], dict[int, float]]:
    """(iteration -> train loss, iteration -> validation loss); a repeated iteration: the last record."""
    records = read_metrics(work / stage / "logs")
    return ({r["iteration"]: r["lm_loss"] for r in records if r["split"] == "train"},
            {r["iteration"]: r["lm_loss"] for r in records if r["split"] == "valid"})


def saved_config(checkpoints: Path) -> Config:
    tag = (checkpoints / "latest").read_text().strip()
    return Config.from_json((checkpoints / tag / "config.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(demo_data, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    directory = tmp_path_factory.mktemp("uninterrupted")
    plan = write_plan(directory, demo_data, two_stages(second_iters=30), checkpoint_factor=5, **ONE_PROCESS)
    return plan, run_driver(plan)


def assert_grown_stage_starts_at_the_previous_loss(work: Path) -> None:
    _, first_valid = stage_records(work, "s1")
    _, second_valid = stage_records(work, "s2")
    before, after = first_valid[max(first_valid)], second_valid[0]
    assert abs(after - before) <= TOLERANCE * abs(before), (before, after)


@pytest.mark.slow
def test_two_stage_plan_runs_end_to_end_and_a_rerun_does_nothing(uninterrupted):
    plan, result = uninterrupted
    work = plan.parent / "work"
    assert "s2 grown from s1: validation loss" in result.stdout and "plan complete" in result.stdout
    assert os.readlink(work / "final") == "s2/checkpoints"
    final = saved_config(work / "final")
    assert [final.qkv_slot_num, final.proj_slot_num, final.ffn_slot_num] == [128, 128, 512]
    assert (work / "final" / "latest").read_text().strip() == "global_step30"
    assert_grown_stage_starts_at_the_previous_loss(work)
    train = [r for r in read_metrics(work / "s2" / "logs") if r["split"] == "train"]
    assert train[0]["iteration"] == 1 and train[0]["consumed_samples"] == 16  # iteration and data reset
    warmup = int(0.25 * 30)
    assert [r["lr"] for r in train[:2]] == pytest.approx([0.005 / warmup, 2 * 0.005 / warmup])  # a fresh warmup
    rerun = run_driver(plan)
    assert "nothing to do: the plan is complete" in rerun.stdout
    parsed = read_plan(plan)
    assert pending_steps(parsed, resolve_plan(parsed)) == []


@pytest.mark.slow
def test_driver_killed_mid_second_stage_finishes_with_the_uninterrupted_losses(uninterrupted, demo_data, tmp_path):
    reference_plan, _ = uninterrupted
    plan = tmp_path / "plan.yml"
    content = yaml.safe_load(reference_plan.read_text())
    plan.write_text(yaml.safe_dump({**content, "work_dir": str(tmp_path / "work")}))
    work, metrics = tmp_path / "work", tmp_path / "work" / "s2" / "logs" / "metrics.jsonl"
    driver = subprocess.Popen([sys.executable, str(DRIVER), str(plan), "--quiet"], cwd=REPO, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and any('"train"' in line for line in metrics.read_text().splitlines())):
        assert driver.poll() is None and time.monotonic() < deadline, "the driver ended before stage s2 trained"
        time.sleep(0.1)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver's process group: it, and nothing it started
    driver.wait()
    killed_at = max(stage_records(work, "s2")[0])
    assert killed_at < 30, "stage s2 finished before the kill"

    result = run_driver(plan)  # waits for the stopped stage to let go of its save directory, then resumes it
    assert not re.search(r"\] (s1: |s2: grow|s2: score)", result.stdout), result.stdout  # done steps are not redone
    resumed = re.search(r"resumed from \S+ at iteration (\d+)", (work / "s2" / "train.log").read_text())
    assert resumed and 0 < int(resumed.group(1)) <= 30
    assert stage_records(work, "s2") == stage_records(reference_plan.parent / "work", "s2")
    assert os.readlink(work / "final") == "s2/checkpoints"


# --- the same plan as a SLURM job chain ---


def wait_for_jobs(env: dict[str, str], jobs: list[str], timeout: float = 900) -> list[str]:
    """The final states of `jobs`, in order, once every one has ended (one scontrol call a second for all)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "-o", "show", "job"], env=env, capture_output=True, text=True)
        known = dict(re.findall(r"^JobId=(\d+) .*?\bJobState=(\S+)", shown.stdout, re.MULTILINE))
        states = [known.get(job, "UNKNOWN") for job in jobs]
        if FINAL_STATES.issuperset(states):
            return states
        time.sleep(1)
    raise AssertionError(f"jobs {jobs} did not finish within {timeout} s")


@pytest.mark.system
@pytest.mark.slow
def test_plan_as_a_slurm_chain_ends_in_the_grown_model(submit_env, demo_data, tmp_path):
    plan = write_plan(tmp_path, demo_data, two_stages())
    submitted = subprocess.run([sys.executable, str(DRIVER), str(plan), "--slurm", "--sbatch-option=--gpus-per-node=0"],
                               cwd=REPO, env=submit_env, capture_output=True, text=True, timeout=300)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    jobs = dict(re.findall(r"submitted (\S+ \S+): job (\d+)", submitted.stdout))
    assert list(jobs) == ["s1 train", "s2 grow", "s2 train", "s2 finish"]
    dependencies = {}
    for name in ("s2 grow", "s2 train"):
        shown = subprocess.run(["scontrol", "-o", "show", "job", jobs[name]], env=submit_env, capture_output=True,
                               text=True).stdout
        dependencies[name] = re.search(r"Dependency=(\S+)", shown).group(1)
    assert dependencies["s2 grow"].startswith(f"afterok:{jobs['s1 train']}")
    assert dependencies["s2 train"].startswith(f"afterok:{jobs['s2 grow']}")

    states = wait_for_jobs(submit_env, list(jobs.values()))
    work = tmp_path / "work"
    outputs = "\n".join(path.read_text() for path in sorted(work.glob("*/slurm-*.out")))
    assert states == ["COMPLETED"] * 4, f"{states}\n{outputs}"
    assert "launching 2 processes: srun" in (next((work / "s2").glob("slurm-train-*.out"))).read_text()
    assert os.readlink(work / "final") == "s2/checkpoints"
    final = saved_config(work / "final")
    assert [final.qkv_slot_num, final.proj_slot_num, final.ffn_slot_num] == [128, 128, 512]
    assert_grown_stage_starts_at_the_previous_loss(work)
    status = subprocess.run([sys.executable, str(DRIVER), str(plan), "--status"], cwd=REPO, env=submit_env,
                            capture_output=True, text=True).stdout
    assert re.search(r"s2\s+done: iteration 6/6", status) and f"train job {jobs['s2 train']} COMPLETED" in status
    assert json.loads((work / "slurm_jobs.jsonl").read_text().splitlines()[0])["job"] == jobs["s1 train"]


@pytest.mark.system
@pytest.mark.slow
def test_a_broken_chain_stops_and_a_rerun_resubmits_from_the_failed_step(submit_env, demo_data, tmp_path):
    plan = write_plan(tmp_path, demo_data, two_stages())
    command = [sys.executable, str(DRIVER), str(plan), "--slurm", "--sbatch-option=--gpus-per-node=0"]

    def submit() -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=REPO, env=submit_env, capture_output=True, text=True, timeout=300)

    jobs = dict(re.findall(r"submitted (\S+ \S+): job (\d+)", submit().stdout))
    subprocess.run(["scancel", jobs["s2 grow"]], env=submit_env, check=True)  # the grow job fails to run
    refused = submit()  # s1 is still training
    assert refused.returncode == 2 and "still queued or running" in refused.stderr
    assert jobs["s1 train"] in refused.stderr
    states = wait_for_jobs(submit_env, list(jobs.values()))
    assert states == ["COMPLETED", "CANCELLED", "CANCELLED", "CANCELLED"]  # afterok never met: the chain stops

    again = submit()
    resubmitted = dict(re.findall(r"submitted (\S+ \S+): job (\d+)", again.stdout))
    assert list(resubmitted) == ["s2 grow", "s2 train", "s2 finish"], again.stdout + again.stderr
    assert wait_for_jobs(submit_env, list(resubmitted.values())) == ["COMPLETED"] * 3
    assert os.readlink(tmp_path / "work" / "final") == "s2/checkpoints"


# --- an online plan (tests/test_progressive_online.py) as one SLURM job ---


@pytest.mark.system
@pytest.mark.slow
def test_an_online_plan_is_one_slurm_job_that_grows_and_publishes_the_final_model(submit_env, demo_data, tmp_path):
    stages = [{"name": "s1", "train_iters": 4}, {"name": "s2", **GROWN, "train_iters": 8}]
    plan = write_plan(tmp_path, demo_data, stages)
    submitted = subprocess.run([sys.executable, str(DRIVER), str(plan), "--online", "--slurm",
                                "--sbatch-option=--gpus-per-node=0"], cwd=REPO, env=submit_env, capture_output=True,
                               text=True, timeout=300)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    jobs = re.findall(r"submitted the online job \(every stage\): job (\d+)", submitted.stdout)
    assert len(jobs) == 1 and submitted.stdout.count("submitted") == 1, submitted.stdout
    assert "--online --status" in submitted.stdout

    states = wait_for_jobs(submit_env, jobs)
    work = tmp_path / "work"
    output = next((work / "job").glob("slurm-train-*.out")).read_text()
    assert states == ["COMPLETED"], output
    assert "launching 2 processes: srun" in output and "the plan and its config files are as pinned" in output
    assert "grew at iteration 4: qkv 64→128, proj 64→128, ffn 256→512" in output
    assert "plan complete" in output and os.readlink(work / "final") == "job/checkpoints"
    assert saved_config(work / "final").ffn_slot_num == 512
    lineage = json.loads((work / "s2" / "lineage.json").read_text())
    assert lineage["source_sha256"] == content_digest(work / "job" / "checkpoints" / "global_step4")

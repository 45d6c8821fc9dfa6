"""A plan as a chain of sbatch jobs, each starting only if the one before succeeded (--dependency=afterok); an
online plan as one training job (PROGRESSIVE_ONLINE=1), which publishes work_dir/final itself when it ends.

Each stage trains in a tools/slurm/train.sbatch job asking num_nodes × num_gpus tasks (with
EVAL_BEFORE_TRAINING=1 after a growth: the job first scores the grown checkpoint; with PROGRESSIVE_PLAN and
PROGRESSIVE_STAGE it first runs this driver's lineage check, so that a config file edited while the job waited
in the queue stops the chain instead of training the stage on it); each growth, and the
publication of work_dir/final at the end, is a small CPU job of its own running this driver's step
(tools/slurm/progressive_step.sbatch). --kill-on-invalid-dep=yes makes SLURM cancel the rest of the chain when
a job fails. What to submit comes from the work_dir (progress.py), so re-running the command after a failure
submits from the failed step on; while jobs of an earlier submission are still queued or running, it refuses.
Submitted jobs are appended to work_dir/slurm_jobs.jsonl, which --status reads.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path

from megatron.progressive.commands import REPO, shown
from megatron.progressive.plan import Plan
from megatron.progressive.progress import EVALUATE, FINISH, GROW, TRAIN, Step
from megatron.progressive.stage_config import ResolvedStage, allocation

TRAIN_SBATCH = "tools/slurm/train.sbatch"
STEP_SBATCH = "tools/slurm/progressive_step.sbatch"
ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                 "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}
DEPENDENCY_PLACEHOLDER = "<job id of {}>"


def jobs_file(plan: Plan) -> Path:
    return plan.work_dir / "slurm_jobs.jsonl"


def submitted_jobs(plan: Plan) -> list[dict]:
    """Every job the driver submitted for this work_dir, oldest first."""
    path = jobs_file(plan)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def job_state(job: str) -> str | None:
    """SLURM's state of `job` (scontrol while the controller remembers it, else sacct), None if neither knows."""
    shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True)
    match = re.search(r"JobState=(\S+)", shown.stdout)
    if match:
        return match.group(1)
    try:
        accounted = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job], capture_output=True,
                                   text=True)
    except FileNotFoundError:
        return None
    states = accounted.stdout.split()
    return states[0] if accounted.returncode == 0 and states else None


def active_jobs(plan: Plan) -> list[tuple[dict, str]]:
    return [(job, state) for job in submitted_jobs(plan) if (state := job_state(job["job"])) in ACTIVE_STATES]


def _step_name(plan: Plan, step: Step) -> str:
    """'s2 grow'; an online plan's one training job: 'job train'."""
    return f"{'job' if plan.online and step.kind == TRAIN else step.stage.name} {step.kind}"


def _job_name(plan: Plan, step: Step) -> str:
    return f"{plan.path.stem}:{_step_name(plan, step).replace(' ', ':')}"


def _job_directory(plan: Plan, step: Step) -> Path:
    return plan.job_directory if plan.online else plan.directory(step.stage)


def _sbatch(plan: Plan, step: Step, dependency: str | None) -> list[str]:
    output = _job_directory(plan, step) / f"slurm-{step.kind}-%j.out"
    command = ["sbatch", "--parsable", f"--job-name={_job_name(plan, step)}", f"--output={output}",
               "--kill-on-invalid-dep=yes"]
    return command + ([f"--dependency=afterok:{dependency}"] if dependency else [])


def _train_job(plan: Plan, resolved: ResolvedStage, evaluate_first: bool) -> tuple[list[str], list[str]]:
    """(sbatch options, script and its arguments) of a stage's training job."""
    nodes, tasks = allocation(resolved.config)
    if "," in str(plan.path):
        raise plan.error(f"the plan's path {plan.path} has a comma, which sbatch --export cannot pass on: rename it")
    exports = ["ALL", f"PROGRESSIVE_PLAN={plan.path}", f"PROGRESSIVE_STAGE={resolved.stage.name}",
               *(["EVAL_BEFORE_TRAINING=1"] if evaluate_first else []),
               *(["PROGRESSIVE_ONLINE=1"] if plan.online else [])]
    options = [f"--nodes={nodes}", f"--ntasks-per-node={tasks}", f"--gpus-per-node={tasks}",
               f"--export={','.join(exports)}"]
    return options, [TRAIN_SBATCH, *map(str, plan.config_files(resolved.stage))]


def _step_job(plan: Plan, step: Step) -> tuple[list[str], list[str]]:
    online = ["--online"] if plan.online else []
    return ["--nodes=1", "--ntasks=1"], [STEP_SBATCH, str(plan.path), *online, "--step", step.kind, "--stage",
                                         step.stage.name]


def chain(plan: Plan, resolved: list[ResolvedStage], steps: list[Step],
          user_options: list[str]) -> list[tuple[Step, list[str]]]:
    """(step, the sbatch command's options and script, dependency left out) per job, in order. A grown stage's
    scoring runs in its training job; the user's options come last, so they override the driver's."""
    by_name = {entry.stage.name: entry for entry in resolved}
    evaluate = {step.stage.name for step in steps if step.kind == EVALUATE}
    if plan.online:  # one job: it trains to the last stage's end, growing as it goes, then publishes work_dir/final
        steps = [Step(TRAIN, plan.stages[-1])] if any(step.kind == TRAIN for step in steps) else steps
    jobs = []
    for step in steps:
        if step.kind == TRAIN:
            options, script = _train_job(plan, by_name[step.stage.name], step.stage.name in evaluate)
        elif step.kind in (GROW, FINISH):
            options, script = _step_job(plan, step)
        else:
            continue
        jobs.append((step, [*options, *user_options, *script]))
    return jobs


def describe_chain(plan: Plan, resolved: list[ResolvedStage], steps: list[Step], user_options: list[str]) -> list[str]:
    """The sbatch commands --slurm would run, dependencies as placeholders (for --dry-run)."""
    lines, previous = [], None
    for step, arguments in chain(plan, resolved, steps, user_options):
        dependency = DEPENDENCY_PLACEHOLDER.format(_step_name(plan, previous)) if previous else None
        lines.append(f"{_step_name(plan, step)}: {shown(_sbatch(plan, step, dependency) + arguments)}")
        previous = step
    return lines


def refuse_active_jobs(plan: Plan) -> None:
    """PlanError while jobs of an earlier submission are queued or running."""
    running = active_jobs(plan)
    if running:
        listed = ", ".join(f"{job['job']} ({job['stage']} {job['step']}, {state})" for job, state in running)
        raise plan.error(f"jobs of an earlier submission are still queued or running: {listed}; follow them with "
                         f"--status, or cancel them (scancel {' '.join(job['job'] for job, _ in running)}) to "
                         "submit again")


def submit_chain(plan: Plan, resolved: list[ResolvedStage], steps: list[Step], user_options: list[str]) -> list[dict]:
    """Submit the chain from the repository root; the jobs submitted, each recorded in slurm_jobs.jsonl."""
    refuse_active_jobs(plan)
    submitted, dependency = [], None
    plan.work_dir.mkdir(parents=True, exist_ok=True)
    for step, arguments in chain(plan, resolved, steps, user_options):
        _job_directory(plan, step).mkdir(parents=True, exist_ok=True)
        command = _sbatch(plan, step, dependency) + arguments
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            raise plan.error(f"sbatch refused the {step.stage.name} {step.kind} job ({result.stderr.strip()}); "
                             f"command: {shlex.join(command)}" + (f". Jobs already submitted: "
                             f"{', '.join(job['job'] for job in submitted)} (scancel them)" if submitted else ""))
        dependency = result.stdout.strip().split(";")[0]
        record = {"job": dependency, "stage": step.stage.name, "step": step.kind,
                  "submitted": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command}
        with open(jobs_file(plan), "a", encoding="utf-8") as stream:
            stream.write(json.dumps(record) + "\n")
        submitted.append(record)
    return submitted

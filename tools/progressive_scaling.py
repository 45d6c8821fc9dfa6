"""Progressive scaling in one command: train a stage, grow it into the next, train that, ... (docs/growth.md).

    python tools/progressive_scaling.py PLAN.yml                 # run the plan here, or continue it
    python tools/progressive_scaling.py PLAN.yml --dry-run       # stages, parameters, FLOPs, commands; runs nothing
    python tools/progressive_scaling.py PLAN.yml --slurm [--sbatch-option=--partition=gpu ...]   # a job chain
    python tools/progressive_scaling.py PLAN.yml --status [--slurm]
    python tools/progressive_scaling.py PLAN.yml --online [--dry-run | --status | --slurm]   # the plan as one job

PLAN.yml (configs/progressive/ has examples):

    configs: [configs/demo.yml]            # config files every stage shares, merged left to right
    work_dir: work_dirs/progressive_demo   # work_dir/NAME/: each stage's checkpoints, logs, stage file
    stages:
      - {name: s1, train_iters: 200}
      - {name: s2, qkv_slot_num: 256, proj_slot_num: 256, ffn_slot_num: 1024, train_iters: 100}

Every stage's config is checked as deepy.py checks it, and each stage against the one before as
tools/grow_checkpoint.py checks a growth, before anything runs. Each stage trains with `deepy.py train.py`; the
next one starts from its final checkpoint grown by tools/grow_checkpoint.py (--reset-iteration: iteration 0, a
fresh warmup and schedule), scored first, so its metrics begin with the grown model's validation loss.
Re-running the same command continues: done stages are skipped, a stage in progress resumes from its latest
checkpoint, an interrupted growth is redone. work_dir/final points at the last stage's checkpoints at the end.
Each stage is pinned when it starts (work_dir/NAME/lineage.json: its resolved config, growth mode and source
checkpoint, by name and content): a re-run that finds the plan, its config files or the source checkpoint changed
for a started stage refuses, naming the key, or with --redo-changed redoes that stage and every stage after it
(grown and scored anew); a started stage without that pin is refused too, unless --adopt-unpinned pins it as the
plan gives it now.
With --online a plan whose stages only grow runs as one job (work_dir/job/), growing its parameter tokens at
each stage's end without stopping (growth_schedule): each stage's train_iters is the job's iteration where it
ends, the first stage's keys are the job's, and a grown stage sets only its token counts, train_iters and the
growth keys; a plan that cannot run so is refused before launch, naming the stage and why. Each stage is pinned
in work_dir/NAME/lineage.json as in a chain.
Paths in the plan are relative to the current directory; run from the repository root for --slurm.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron.host.startup import collector_paused

with collector_paused():  # torch and DeepSpeed, imported below (megatron/host/startup.py)
    from megatron.config import ConfigError
    from megatron.progressive.commands import REPO, shown
    from megatron.progressive.dry_run import stage_table, step_commands
    from megatron.progressive.lineage_check import (
        ADOPT_FLAG,
        CHECK,
        REDO_FLAG,
        REPLACED,
        changed_stage_lines,
        prepare_stages,
        verdict,
    )
    from megatron.progressive.local import hold_work_dir, run_plan, run_single_step
    from megatron.progressive.plan import Plan, read_plan
    from megatron.progressive.processes import Interrupted, StepFailed
    from megatron.progressive.progress import FINISH, GROW, check_layout, pending_steps, retract_stale_final
    from megatron.progressive.slurm import refuse_active_jobs, submit_chain
    from megatron.progressive.stage_config import ResolvedStage, resolve_plan
    from megatron.progressive.status import status_lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plan", type=Path, help="the plan file (YAML)")
    parser.add_argument("--dry-run", action="store_true", help="print stages, costs and commands; run nothing")
    parser.add_argument("--slurm", action="store_true", help="submit the plan as a chain of sbatch jobs (with "
                        "--online: as one job)")
    parser.add_argument("--online", action="store_true",
                        help="run every stage as one job that grows at each stage's end (growth_schedule), without "
                        "stopping: each stage's train_iters is the job's iteration where it ends, and a grown stage "
                        "sets only its parameter-token counts, train_iters and the growth keys")
    parser.add_argument("--sbatch-option", action="append", default=[], metavar="OPTION",
                        help="an sbatch option for every job of the chain, after the driver's own (repeatable), "
                        "e.g. --sbatch-option=--partition=gpu or --sbatch-option=--gpus-per-node=0 on a CPU cluster")
    parser.add_argument("--status", action="store_true", help="one line per stage (and its jobs); run nothing")
    parser.add_argument(REDO_FLAG, action="store_true",
                        help="redo a started stage whose config, growth mode or source changed since it started "
                        "(the shared config files or the plan edited), and every stage after it, instead of refusing; "
                        "their directories are moved to work_dir/replaced/")
    parser.add_argument(ADOPT_FLAG, action="store_true",
                        help="pin a started stage that has no lineage.json (a driver that wrote none started it, or "
                        "the file was deleted) or one naming its source by tag only, as the plan and its config "
                        "files give it now, instead of refusing")
    parser.add_argument("--quiet", action="store_true", help="run locally without echoing each step's output")
    parser.add_argument("--step", choices=(GROW, FINISH, CHECK), help=argparse.SUPPRESS)  # a SLURM chain's jobs
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.slurm and Path.cwd().resolve() != REPO:
        parser.error(f"--slurm submits tools/slurm/*.sbatch, which run from the repository root: cd {REPO} first")
    if args.step and not args.stage:
        parser.error("--step needs --stage")
    return args


def _resolve(args: argparse.Namespace) -> tuple[Plan, list[ResolvedStage]]:
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout when it is imported
        plan = read_plan(args.plan, online=args.online)
        check_layout(plan)
        # --status and the chain's step jobs judge stages as SLURM jobs do: num_nodes × num_gpus processes
        return plan, resolve_plan(plan, slurm=args.slurm or args.status or args.step is not None)


def submit(plan: Plan, resolved: list[ResolvedStage], args: argparse.Namespace) -> int:
    hold_work_dir(plan)
    refuse_active_jobs(plan)  # before a redo moves a stage a job may be writing
    for line in prepare_stages(plan, resolved, args.redo_changed, args.adopt_unpinned):
        print(line)
    steps = pending_steps(plan, resolved)
    if not steps:
        print(f"nothing to do: the plan is complete ({plan.final})")
        return 0
    retract_stale_final(plan, steps)
    for job in submit_chain(plan, resolved, steps, args.sbatch_option):
        online_job = plan.online and job["step"] != FINISH
        print(f"submitted {'the online job (every stage)' if online_job else job['stage'] + ' ' + job['step']}: "
              f"job {job['job']}")
    online = ["--online"] if plan.online else []
    print(f"follow it with: {shown([sys.executable, sys.argv[0], str(args.plan), *online, '--status'])}")
    return 0


def dry_run(plan: Plan, resolved: list[ResolvedStage], args: argparse.Namespace) -> None:
    """Print the stages, their costs and the steps a run would do, after the checks the run makes first: where
    it would refuse (a started stage changed or not pinned, a chain's jobs still queued), PlanError as it would."""
    mode = ("one SLURM job" if plan.online else "a SLURM job chain") if args.slurm else "this machine"
    mode += ", as one job growing at each stage's end (--online)" if plan.online else ""
    print(f"plan {plan.path}: {len(resolved)} stages in {plan.work_dir}, on {mode}\n")
    print("\n".join(stage_table(resolved)))
    changed = changed_stage_lines(plan, resolved)
    if changed:
        print("\n" + "\n".join(changed))
    if args.slurm:
        refuse_active_jobs(plan)
    redone = verdict(plan, resolved, args.redo_changed, args.adopt_unpinned).redone
    steps = pending_steps(plan, resolved, {stage.name for stage in redone})
    if redone:
        print(f"\nwith {REDO_FLAG}: {', '.join(stage.name for stage in redone)} redone from scratch (their "
              f"directories moved to {plan.work_dir / REPLACED}/)")
    print("\nsteps to do:" if steps else "\nnothing to do: the plan is complete")
    print("\n".join(f"  {line}" for line in step_commands(plan, resolved, steps, args.slurm, args.sbatch_option)))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        plan, resolved = _resolve(args)
        if args.step:
            run_single_step(plan, resolved, args.step, args.stage)
            return 0
        if args.status:
            print("\n".join(status_lines(plan, resolved)))
            return 0
        if args.dry_run:
            dry_run(plan, resolved, args)
            return 0
        if args.slurm:
            return submit(plan, resolved, args)
        run_plan(plan, resolved, echo=not args.quiet, redo=args.redo_changed, adopt=args.adopt_unpinned)
        return 0
    except (ConfigError, StepFailed, OSError) as error:
        print(f"progressive_scaling.py: error: {error}", file=sys.stderr)
        return 1 if isinstance(error, StepFailed) else 2
    except Interrupted as stop:
        print(f"progressive_scaling.py: {stop}", file=sys.stderr)
        return 128 + stop.number


if __name__ == "__main__":
    sys.exit(main())

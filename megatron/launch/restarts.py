"""max_restarts: a training job whose launch fails is launched again, inside the same job, from its latest checkpoint.

deepy.py's own loop around the launcher (local_ranks.py, DeepSpeed's runner, srun inside the allocation, mpirun):
a launch that fails (a rank exited non-zero, so the launcher ended every rank) is run again with the same command,
up to max_restarts times; its ranks resume from the latest checkpoint in `load`, which the config requires to be
`save` (config/validate.py). Each restart is said in one line (which rank ended first and how, from which
checkpoint) and appended to metrics.jsonl as a "restart" record at the iteration it resumes from, which the
resumed run keeps while it drops the records it logs again (training/metrics.py). A stop you asked for is never
restarted, nor is a job whose checkpoints the ranks would refuse.

torchrun's elastic agent was measured for this and not taken (docs/reliability.md, "Restarts inside the job"): it
exits 1 on a killed rank instead of 128+N, dies of a SIGUSR1 (SLURM's --signal=USR1) leaving its ranks running,
and would restart ranks that a stop ended while they were starting.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from megatron.checkpoint.safety import CheckpointRefused
from megatron.checkpoint.selection import tag_to_resume_before_launch
from megatron.config import Config
from megatron.config.run_inputs import CLUSTER_CHECK_SCRIPT, INFERENCE_SCRIPTS
from megatron.host.metrics_file import append_record
from megatron.launch.supervise import LaunchEnd, run_launcher, say

RESTART_SPLIT = "restart"


def restarts_apply(cfg: Config, script: str) -> bool:
    """Whether `script` is a training run, which max_restarts restarts (an inference run or a cluster check has
    no checkpoint to go on from)."""
    name = Path(script).name
    return name not in INFERENCE_SCRIPTS and name != CLUSTER_CHECK_SCRIPT and not cfg.eval_only


def _resume_point(load: str) -> tuple[str | None, int]:
    """The checkpoint the next launch's ranks resume from (None: none yet) and its iteration; CheckpointRefused if
    they would refuse every one there."""
    tag, _ = tag_to_resume_before_launch(load)
    found = re.match(r"global_step(\d+)", tag or "")
    return tag, int(found.group(1)) if found else 0


def _cause(end: LaunchEnd) -> str:
    return end.first_to_end or f"the launcher exited {end.code} (its output above names the rank)"


def run_with_restarts(cfg: Config, command: list[str], script: str) -> int:
    """Run the launcher `command` of `script`'s ranks, again after each failure while restarts are left; deepy.py's
    exit status: the last launch's."""
    stops: list[int] = []
    end = run_launcher(command, script, stops)
    if not restarts_apply(cfg, script):
        return end.code
    for restart in range(1, cfg.max_restarts + 1):
        if end.code == 0 or stops:
            return end.code
        try:
            tag, iteration = _resume_point(cfg.load)
        except CheckpointRefused as refused:
            say(f"deepy.py: not restarted: the ranks would refuse every checkpoint: {refused}")
            return end.code
        start = f"{cfg.load}/{tag} (iteration {iteration})" if tag else f"the start: {cfg.load} holds no checkpoint yet"
        say(f"deepy.py: restart {restart} of {cfg.max_restarts} (max_restarts): {_cause(end)}; every rank ended, and "
            f"all start again from {start}")
        if cfg.log_dir:
            append_record(cfg.log_dir, {"iteration": iteration, "split": RESTART_SPLIT, "restart": restart,
                                        "max_restarts": cfg.max_restarts, "cause": _cause(end), "checkpoint": tag,
                                        "time": time.time()})
        end = run_launcher(command, script, stops)
    if end.code and not stops and cfg.max_restarts:
        say(f"deepy.py: {script} failed again with no restart left (max_restarts = {cfg.max_restarts}): the job ends "
            f"(exit status {end.code}). Fix the cause above and run the same command: it resumes from the latest "
            "checkpoint")
    return end.code

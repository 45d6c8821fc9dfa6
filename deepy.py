#!/usr/bin/env python
"""Launch a script on every rank with a resolved, validated config.

    python deepy.py train.py configs/demo.yml [more.yml ...] [key=value ...]

Config files merge left to right; `key=value` arguments override single keys
(the value is read as YAML: `train_iters=100`, `optimizer={type: Adam, params: {lr: 0.001}}`).
Everything is checked here, before any process starts: the config, the
hostfile and include/exclude, the launcher's tools and ssh reachability, and
the files the run reads (launch/preflight.py), and that this machine's memory holds its ranks and
sample index (launch/node_resources.py); a run whose checkpoint already reached train_iters is not
launched (it says so and exits 0). A checkpoint saved on another parallel layout is re-sharded into
this one beside it, its global batch kept (growth/reshard_on_resume.py, launch/global_batch.py). The
config is printed once, with a warning per optimizer or data key changed from the checkpoint it resumes
(formats/deepspeed/changed_settings.py), and passed to every rank. SIGTERM, Ctrl-C, SIGHUP, SIGUSR1 or SIGUSR2
reaches every rank, which saves and
stops (launch/supervise.py). With max_restarts, a training job whose launch fails starts again from its latest
checkpoint, every rank, up to that many times (launch/restarts.py). DeepSpeed's compiled ops are kept with this Python environment
(host/extension_cache.py). `launcher` picks how ranks
start (docs/cluster.md): pdsh, the default (`num_gpus` processes on this machine, started by
launch/local_ranks.py, or DeepSpeed's runner on the hosts of a hostfile), srun (slurm) or mpirun
(openmpi, mpich).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from megatron.cli import JOB_STOP_SIGNALS, stop_at_once_while_starting
from megatron.host.startup import collector_paused

if __name__ == "__main__":  # before the imports below, which take seconds
    # A stop (Ctrl-C, SIGTERM, SIGUSR1, ...) while deepy.py imports and checks: one line and 128+N, at once
    # (megatron/cli.py); from the launch on, megatron/launch/supervise.py takes the signals over.
    stop_at_once_while_starting("deepy.py", "before any process started", JOB_STOP_SIGNALS)

with collector_paused():  # torch and DeepSpeed, imported below: 400,000 objects (megatron/host/startup.py)
    from megatron.config import ConfigError, inactive_keys, slow_keys
    from megatron.config.argument import encode_config
    from megatron.config.loader import keys_set
    from megatron.config.run_inputs import INFERENCE_SCRIPTS
    from megatron.config.validate import raise_if_any
    from megatron.formats.deepspeed.changed_settings import resume_warnings
    from megatron.growth.notes import launch_notes as growth_notes
    from megatron.host.extension_cache import use_environment_cache
    from megatron.launch.command import check_launcher, launch_command, launch_notes
    from megatron.launch.global_batch import kept_batch_note
    from megatron.launch.node_resources import node_core_notes, node_memory_problems
    from megatron.launch.preflight import (launches_here, nothing_left_to_train, preflight_notes,
                                           preflight_problems, reshard_before_launch)
    from megatron.launch.resolve import resolve_run
    from megatron.launch.resources import world_size
    from megatron.launch.restarts import run_with_restarts
    from megatron.launch.ssh import check_reachable

USAGE = "usage: python deepy.py SCRIPT.py CONFIG.yml [CONFIG.yml ...] [key=value ...]"


def split_arguments(args: list[str]) -> tuple[str, list[str], list[str]]:
    if len(args) < 2:
        raise ConfigError(USAGE)
    script, rest = args[0], args[1:]
    if not Path(script).is_file():
        raise ConfigError(f"script {script!r} not found\n{USAGE}")
    files = [a for a in rest if "=" not in a]
    overrides = [a for a in rest if "=" in a]
    if not files:
        raise ConfigError(f"no config file given\n{USAGE}")
    return script, files, overrides


def main(argv: list[str]) -> int:
    use_environment_cache()
    try:
        script, files, overrides = split_arguments(argv)
        from deepspeed.accelerator import get_accelerator

        device = get_accelerator().device_name()
        cfg, slots = resolve_run(files, overrides, script, device=device)
        check_launcher(cfg, slots)
        check_reachable(cfg, slots)
        raise_if_any(preflight_problems(cfg, slots))
        raise_if_any(node_memory_problems(cfg, slots, device))
        done = nothing_left_to_train(cfg)
        resharded = None if done else reshard_before_launch(cfg, world_size(slots))
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    if done:
        print(f"deepy.py: {done}", flush=True)
        return 0
    print(cfg.format(), flush=True)
    for key, reason in [*inactive_keys(cfg, device), *launch_notes(cfg)]:
        print(f"note: {key} has no effect here: {reason}", flush=True)
    for key, why in slow_keys(cfg, device):
        print(f"note: {key}: {why}", flush=True)
    for note in node_core_notes(cfg, slots):
        print(f"note: {note}", flush=True)
    if Path(script).name not in INFERENCE_SCRIPTS:
        for note in [*preflight_notes(cfg), *growth_notes(cfg, keys_set(files, overrides))]:
            print(f"note: {note}", flush=True)
        for warning in resume_warnings(cfg):
            print(f"warning: {warning}", flush=True)
        for line in filter(None, [kept_batch_note(cfg), resharded]):
            print(line, flush=True)
    command = launch_command(cfg, slots, script, ["--megatron_config", encode_config(cfg)])
    print(f"launching {world_size(slots)} processes: {shlex.join(command[:-1])} <config>", flush=True)
    here = launches_here(cfg, slots)
    if here:  # the ranks need not detect it again, each warning "Setting accelerator to CPU" on a CPU machine
        os.environ.setdefault("DS_ACCELERATOR", device)
    return run_with_restarts(cfg, command, script)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python
"""Launch a script on every rank with a resolved, validated config.

    python deepy.py train.py configs/demo.yml [more.yml ...] [key=value ...]

Config files merge left to right; `key=value` arguments override single keys
(the value is read as YAML: `train_iters=100`, `optimizer={type: Adam, params: {lr: 0.001}}`).
The config is validated here, before any process starts, printed once, and
passed to every rank; DeepSpeed's launcher starts `num_gpus` processes per node
(on a CPU machine: `num_gpus` local processes) or the hosts of a hostfile.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import zlib
from pathlib import Path

from megatron.config import ConfigError, check_run_inputs, inactive_keys, load_config
from megatron.launcher import hostfile_slots, launcher_command

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
    try:
        script, files, overrides = split_arguments(argv)
        probe = load_config(files, overrides)
        slots = hostfile_slots(probe)
        world_size = sum(slots.values())
        cfg = load_config(files, [*overrides, f"user_script={script}"], world_size=world_size)
        from deepspeed.accelerator import get_accelerator

        device = get_accelerator().device_name()
        check_run_inputs(cfg, device)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    print(cfg.format(), flush=True)
    for key, reason in inactive_keys(cfg, device):
        print(f"note: {key} has no effect here: {reason}", flush=True)
    encoded = base64.urlsafe_b64encode(zlib.compress(cfg.to_json().encode(), 9)).decode()
    command = launcher_command(cfg, slots, script, ["--megatron_config", encoded])
    return subprocess.call(command, env=os.environ.copy())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

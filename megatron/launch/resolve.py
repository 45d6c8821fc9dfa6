"""The config a launch runs with, resolved and checked as deepy.py does before any process starts.

One function, so that deepy.py and tools that plan launches ahead (tools/progressive_scaling.py validates every
stage of a plan before the first one runs) refuse exactly the same configs.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path

from megatron.config import Config, check_run_inputs, load_config
from megatron.config.loader import keys_set
from megatron.config.schema import GPT_NEOX_PORT
from megatron.launch.global_batch import kept_batch_override
from megatron.launch.hosts import is_local_host
from megatron.launch.ports import free_port
from megatron.launch.resources import Slots, process_slots, world_size


def resolve_run(files: Sequence[str | Path], overrides: Sequence[str], script: str,
                slots: Slots | None = None, device: str | None = None) -> tuple[Config, Slots]:
    """The validated config of `script` run with `files` + `overrides`, and the slots its processes take.

    The slots are this machine's or the hostfile's (as deepy.py finds them) unless `slots` gives the ones a
    future allocation will offer (a SLURM job's nodes); the batch arithmetic uses their count. `device`
    ('cpu', 'cuda', ...) is the accelerator the ranks will use, by default this machine's. deepy.py decides
    the script, the launch's identity and, when none is given, master_port (ports.py). A resume keeps the
    checkpoint's global batch unless the config sets train_batch_size (global_batch.py).
    """
    from deepspeed.accelerator import get_accelerator

    local_device = get_accelerator().device_name()
    given = load_config(files, overrides)
    if slots is None:
        slots = process_slots(given, local_device, get_accelerator().device_count())
    decided = [f"user_script={script}", f"launch_id={uuid.uuid4().hex}"]
    if given.master_port is None:
        local = given.launcher == "pdsh" and all(is_local_host(host) for host in slots)
        decided.append(f"master_port={free_port() if local else GPT_NEOX_PORT}")
    cfg = load_config(files, [*overrides, *decided], world_size=world_size(slots))
    kept = kept_batch_override(cfg, keys_set(files, overrides))
    if kept:
        cfg = load_config(files, [*overrides, *decided, kept], world_size=world_size(slots))
    check_run_inputs(cfg, device or local_device)
    return cfg, slots

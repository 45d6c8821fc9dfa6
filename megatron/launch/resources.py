"""Which slots (devices) of which hosts a run gets.

Resolved in deepy.py before the config is, because the batch sizes depend on
the world size. GPT-NeoX / DeepSpeed semantics: the pool is the hostfile, or
this machine; `include`/`exclude` pick hosts and slots (HOST[:SLOT,...][@HOST...]);
`num_nodes` keeps the first N hosts; `num_gpus` the first N slots of each host
(include/exclude, when given, decide the slots instead).
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron.config import Config, ConfigError
from megatron.launch.hostfile import read_hostfile

Slots = dict[str, list[int]]
"""Host -> slot (device) ids it runs a process on; hosts in rank order."""


def _pool(cfg, device: str, device_count: int) -> tuple[dict[str, int], str]:
    """Slots per host before any filter, and how to name their source in messages."""
    if cfg.hostfile:
        return read_hostfile(cfg.hostfile), f"hostfile {cfg.hostfile}"
    if device == "cpu":
        return {"localhost": cfg.num_gpus or 1}, "this machine"
    return {"localhost": device_count}, f"this machine ({device_count} {device} devices)"


def _filtered(pool: dict[str, int], cfg, source: str) -> Slots:
    from deepspeed.launcher.runner import parse_inclusion_exclusion

    try:
        active = parse_inclusion_exclusion(pool, cfg.include or "", cfg.exclude or "")
    except ValueError as error:
        raise ConfigError(
            f"include={cfg.include!r} exclude={cfg.exclude!r} on {source}: {error}; "
            "the format is HOST[:SLOT[,SLOT...]][@HOST...]"
        ) from None
    if not active:
        raise ConfigError(f"include={cfg.include!r} exclude={cfg.exclude!r} leave no slots of {source}")
    return dict(active)


def process_slots(cfg: Config, device: str, device_count: int) -> Slots:
    """The slots every process of the run occupies; more processes than slots is an error."""
    pool, source = _pool(cfg, device, device_count)
    hosts = list(_filtered(pool, cfg, source).items())
    if cfg.num_nodes > 0:
        if cfg.num_nodes > len(hosts):
            raise ConfigError(f"num_nodes={cfg.num_nodes} but {source} offers {len(hosts)} hosts; lower num_nodes")
        hosts = hosts[: cfg.num_nodes]
    if cfg.num_gpus and not (cfg.include or cfg.exclude):
        short = {host: len(ids) for host, ids in hosts if len(ids) < cfg.num_gpus}
        if short:
            raise ConfigError(
                f"num_gpus={cfg.num_gpus} processes per node, but {source} has fewer slots on {short}; "
                "lower num_gpus or give those hosts more slots"
            )
        hosts = [(host, ids[: cfg.num_gpus]) for host, ids in hosts]
    return dict(hosts)


def local_device_ids(ids: list[int], device: str, variable: str, environment: Mapping[str, str]) -> list[str]:
    """The devices this machine's slots `ids` name: slot i is the i-th entry of the list a scheduler may have set
    in `variable` (CUDA_VISIBLE_DEVICES=2,3: the job's GPUs, others may be another job's), else device i. On
    CPUs the slots are processes, not devices."""
    listed = environment.get(variable, "").strip()
    if device == "cpu" or not listed:
        return [str(slot) for slot in ids]
    entries = [entry.strip() for entry in listed.split(",")]
    beyond = [slot for slot in ids if slot >= len(entries)]
    if beyond:
        raise ConfigError(
            f"{variable}={listed} gives this job {len(entries)} devices, but the run takes slots {ids} of this "
            f"machine (slot i is its i-th device); take at most {len(entries)} (num_gpus, include, the hostfile's "
            f"slots) or give the job more devices"
        )
    return [entries[slot] for slot in ids]


def world_size(slots: Slots) -> int:
    return sum(len(ids) for ids in slots.values())


def require_leading_slots(slots: Slots, launcher: str) -> None:
    """srun and mpirun start N processes per host and cannot choose device ids: slots must be 0..N-1."""
    for host, ids in slots.items():
        if ids != list(range(len(ids))):
            raise ConfigError(
                f"launcher {launcher} starts processes by count and cannot pick slots {ids} of {host}; "
                "use include/exclude on whole hosts, or the first N slots of a host"
            )


def uniform_slots_per_host(slots: Slots, launcher: str) -> int:
    """Processes per host for launchers that take one count for every host (srun, MPICH)."""
    require_leading_slots(slots, launcher)
    counts = {host: len(ids) for host, ids in slots.items()}
    if len(set(counts.values())) > 1:
        raise ConfigError(
            f"launcher {launcher} runs the same number of processes on every host, got {counts}; "
            "give every host the same slots (or set num_gpus)"
        )
    return next(iter(counts.values()))

"""Section 1, environment: what every rank runs on, and whether the ranks agree.

- each rank's host, device, driver, Python, torch, CUDA, NCCL, DeepSpeed and Triton versions, and its free
  device memory; a rank that differs from the others (the majority) is named with both values;
- the devices of each node: at least as many as the launcher started ranks there (the hostfile's slots or
  SLURM's tasks), as many as SLURM promised where it says (SLURM_GPUS_ON_NODE), and no device bound by two
  ranks; a device with much less free memory than its peers (another process holds it) is named;
- `save`, `load`, the datasets and the tokenizer are the same files on every node (shared_paths.py).

facts: `devices` (every rank has a device of its own: the later sections can run), `save_shared`.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from collections import Counter
from pathlib import Path

import torch
from deepspeed.accelerator import get_accelerator

from megatron.cluster_check.context import CheckContext
from megatron.cluster_check.ranks import gather
from megatron.cluster_check.report import SectionResult
from megatron.cluster_check.shared_paths import check_directory, check_files
from megatron.config.run_inputs import dataset_prefixes
from megatron.data.indexed_dataset import index_file_path
from megatron.training.utilization import device_product_name

NAME = "environment"
COMPARED = ("device", "driver", "python", "torch", "cuda", "nccl", "deepspeed", "triton")
LOW_FREE_MEMORY = 0.9  # a device with less than this share of its peers' most free memory is named
GIB = 2**30
FIXES = {
    "device": "use one kind of device in a job (a partition or constraint of one GPU model)",
    "driver": "install the same NVIDIA driver on every node",
    "python": "run every node from the same Python environment (one image, or one shared virtual environment)",
}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _nvidia_driver() -> str | None:
    """The kernel module's version ("550.54.15"), read from the driver's own file."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module\s+(\S+)", text)
    return found[1] if found else text.splitlines()[0]


def _nccl_version() -> str:
    version = torch.cuda.nccl.version()  # (2, 21, 5); an int in older torch
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _free_and_total_memory(device_name: str, index: int) -> tuple[int, int]:
    """Free and total bytes of this rank's device as the driver sees them (other processes' use included); on a
    CPU, the host's available and total memory."""
    module = getattr(torch, device_name, None)
    if device_name != "cpu" and module is not None and hasattr(module, "mem_get_info"):
        return module.mem_get_info(index)
    accelerator = get_accelerator()
    return int(accelerator.available_memory()), int(accelerator.total_memory())


def rank_facts(device: torch.device) -> dict:
    """This rank's software, device and memory."""
    import deepspeed

    accelerator = get_accelerator()
    name = accelerator.device_name()
    on_cuda = name == "cuda"
    index = device.index if device.index is not None else 0
    identity = None
    if on_cuda:
        properties = torch.cuda.get_device_properties(index)
        identity = str(getattr(properties, "uuid", index))
    free, total = _free_and_total_memory(name, index)
    return {
        "device": device_product_name(accelerator), "device_type": name,
        "device_identity": identity, "devices_visible": accelerator.device_count() if name != "cpu" else None,
        "driver": _nvidia_driver() if on_cuda else None, "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": _nccl_version() if on_cuda else None,
        "deepspeed": deepspeed.__version__, "triton": _version("triton"),
        "free_memory": free, "total_memory": total,
        "slurm_gpus_on_node": os.environ.get("SLURM_GPUS_ON_NODE"),
    }


def _mismatches(result: SectionResult, context: CheckContext, facts: list[dict]) -> None:
    ranks = context.ranks
    for field in COMPARED:
        values = Counter(f[field] for f in facts)
        if len(values) == 1:
            continue
        majority = values.most_common(1)[0][0]
        others = {value for value in values if value != majority}
        for value in others:
            differing = [rank for rank, f in enumerate(facts) if f[field] == value]
            result.fail(ranks.name(differing), f"{field} {value} where the other ranks have {majority}",
                        FIXES.get(field, f"install the same {field} on every node (one image or environment)"))


def _devices(result: SectionResult, context: CheckContext, facts: list[dict]) -> list[str]:
    """Per host: ranks, devices seen, SLURM's promise; returns the report's table rows."""
    ranks, rows = context.ranks, []
    for host in ranks.hosts():
        on_host = ranks.on_host(host)
        first = facts[on_host[0]]
        visible, promised = first["devices_visible"], first["slurm_gpus_on_node"]
        rows.append(f"| {host} | {len(on_host)} | {'-' if visible is None else visible} | {promised or '-'} |")
        if visible is None:  # CPU processes: no devices to count
            continue
        if visible < len(on_host):
            result.fail(f"host {host}", f"{visible} devices visible for {len(on_host)} ranks",
                        f"check the devices of {host} (nvidia-smi; a device that fell off the bus), or start fewer "
                        "ranks there (the hostfile's slots, --ntasks-per-node)")
        if promised and promised.isdigit() and int(promised) != visible:
            result.fail(f"host {host}", f"SLURM promised {promised} GPUs (SLURM_GPUS_ON_NODE) but {visible} are "
                        "visible", f"check the devices of {host} and CUDA_VISIBLE_DEVICES in the job's environment")
        identities = Counter(facts[r]["device_identity"] for r in on_host)
        for identity, count in identities.items():
            if count > 1:
                shared = [r for r in on_host if facts[r]["device_identity"] == identity]
                result.fail(ranks.name(shared), f"{count} ranks use one device ({identity})",
                            "give every rank its own device: one rank per GPU, LOCAL_RANK distinct on a node")
    return rows


def _memory(result: SectionResult, context: CheckContext, facts: list[dict]) -> None:
    """On devices of one kind: a rank with much less free memory than the most free is named (CPU ranks share
    their host's memory: nothing to compare)."""
    if facts[0]["device_type"] == "cpu":
        return
    most = max(f["free_memory"] for f in facts)
    for rank, f in enumerate(facts):
        if f["free_memory"] < LOW_FREE_MEMORY * most:
            result.fail(context.ranks.who(rank), f"{f['free_memory'] / GIB:.1f} GiB free on its device where "
                        f"others have {most / GIB:.1f} GiB", f"another process holds memory on that device: "
                        f"nvidia-smi on {context.ranks.hosts_by_rank[rank]}, end it or drain the node")


def _paths(result: SectionResult, context: CheckContext) -> bool:
    """save, load, the data and the tokenizer; returns whether `save` is shared (True when unset)."""
    cfg, ranks = context.cfg, context.ranks
    save_shared = True
    if cfg.save:
        save_shared = check_directory(result, ranks, "save", cfg.save, context.tag, written=True)
    if cfg.load and Path(cfg.load).resolve() != Path(cfg.save or "").resolve():
        check_directory(result, ranks, "load", cfg.load, context.tag, written=False)
    files = []
    for key, prefix in dataset_prefixes(cfg):
        files += [(key, index_file_path(prefix)), (key, Path(f"{prefix}.bin"))]
    for key in ("vocab_file", "merge_file"):
        if getattr(cfg, key):
            files.append((key, Path(getattr(cfg, key))))
    check_files(result, ranks, files)
    return save_shared


def run(context: CheckContext) -> SectionResult:
    result = SectionResult(NAME)
    facts = gather(rank_facts(context.device))
    rows = _devices(result, context, facts)
    devices_ok = not result.findings
    _mismatches(result, context, facts)
    _memory(result, context, facts)
    save_shared = _paths(result, context)
    result.facts = {"devices": devices_ok, "save_shared": save_shared}
    first = facts[0]
    free = [f["free_memory"] for f in facts]
    result.figures = [
        "| field | rank 0's value | ranks that differ |", "|---|---|---|",
        *[f"| {field} | {first[field] or '-'} | {sum(f[field] != first[field] for f in facts)} |"
          for field in COMPARED],
        "", f"Free {'host' if first['device_type'] == 'cpu' else 'device'} memory: least {min(free) / GIB:.1f} GiB, "
        f"most {max(free) / GIB:.1f} GiB (of {first['total_memory'] / GIB:.1f} GiB).", "",
        "| host | ranks | devices visible | SLURM_GPUS_ON_NODE |", "|---|---|---|---|", *rows, "",
        f"Paths compared on every rank: save {context.cfg.save or '(unset)'}, load {context.cfg.load or '(unset)'}, "
        f"{len(dataset_prefixes(context.cfg))} dataset(s) and the tokenizer.",
    ]
    result.summary = (f"{first['device']}, torch {first['torch']}, DeepSpeed {first['deepspeed']}"
                      + (f", CUDA {first['cuda']}, NCCL {first['nccl']}, driver {first['driver']}"
                         if first["device_type"] == "cuda" else "")
                      + f"; {len(context.ranks.hosts())} host(s); {len(result.findings)} problem(s)")
    return result

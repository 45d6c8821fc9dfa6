"""Model FLOPs utilisation (MFU) and peak memory for the training log.

Two counts of megatron/model/flops.py, as Megatron and PaLM use them: the FLOP/s a device logs include the
forward that activation checkpointing recomputes (the work the hardware did; GPT-NeoX and Megatron log this),
while MFU counts the model's FLOPs alone (PaLM's definition: recomputation is overhead, not model work), over the
device's peak. The peak is the data sheet's *dense* 16-bit tensor-core figure, found by device name: data sheets
headline the 2:4-sparse figure, twice as large, which halves a reported MFU. `peak_tflops` in the config
overrides the table (another GPU, a power-capped card, an fp32 run). A CPU has no such figure: its log keeps
GFLOP/s, and MFU only when `peak_tflops` is given.
"""

from __future__ import annotations

import resource
import sys

import torch

# (substrings the device name must all contain, dense bf16/fp16 TFLOP/s per device); the first match wins, so
# the PCIe and NVL variants come before their SXM parts' plain name.
DENSE_BF16_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "PCIe"), 756.0),
    (("H100", "NVL"), 835.0),
    (("H200", "NVL"), 835.0),
    (("H100",), 989.0),
    (("H200",), 989.0),
    (("B200",), 2250.0),
    (("A100",), 312.0),
)


def table_peak_tflops(device_name: str) -> float | None:
    """The table's dense bf16 TFLOP/s of the device `device_name` names (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    for parts, tflops in DENSE_BF16_TFLOPS:
        if all(part in device_name for part in parts):
            return tflops
    return None


def device_peak_flops(device_type: str, device_name: str, configured_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device: `configured_tflops` (the config's peak_tflops) if set, else the table's figure
    for a GPU it knows, else None (no MFU is logged)."""
    if configured_tflops is not None:
        return configured_tflops * 1e12
    if device_type == "cpu":
        return None
    tflops = table_peak_tflops(device_name)
    return None if tflops is None else tflops * 1e12


def device_product_name(accelerator) -> str:
    """The device's product name ("NVIDIA H100 80GB HBM3"): torch's per-backend module (torch.cuda, torch.xpu)
    knows it, DeepSpeed's accelerator does not; "cpu" on a CPU."""
    backend = accelerator.device_name()
    if backend == "cpu":
        return "cpu"
    module = getattr(torch, backend, None)
    if module is None or not hasattr(module, "get_device_name"):
        return backend
    return module.get_device_name(accelerator.current_device())


def peak_memory_bytes(accelerator) -> int:
    """Most memory this rank has held: the device allocator's peak on an accelerator (no device sync), the
    process's peak resident set on a CPU."""
    if accelerator.device_name() == "cpu":
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes
    return int(accelerator.max_memory_allocated())


class Utilization:
    """What one rank's log line reports about speed and memory, from the run's FLOPs per token."""

    def __init__(self, accelerator, hardware_flops_per_token: int, model_flops_per_token: int, world_size: int,
                 configured_tflops: float | None):
        self.accelerator = accelerator
        self.hardware_flops_per_token = hardware_flops_per_token
        self.model_flops_per_token = model_flops_per_token
        self.world_size = world_size
        self.on_cpu = accelerator.device_name() == "cpu"
        name = device_product_name(accelerator)
        self.peak_flops = device_peak_flops(accelerator.device_name(), name, configured_tflops)
        self.unknown_device = None if self.peak_flops or self.on_cpu else name

    def record(self, tokens_per_sec: float) -> dict[str, float | int | None]:
        """metrics.jsonl fields: total and per-device FLOP/s (recomputation included), MFU (model FLOPs; None
        without a peak), peak memory."""
        flops = tokens_per_sec * self.hardware_flops_per_token
        model_per_device = tokens_per_sec * self.model_flops_per_token / self.world_size
        return {
            "flops_per_sec": flops,
            "tflops_per_device": flops / self.world_size / 1e12,
            "mfu": model_per_device / self.peak_flops if self.peak_flops else None,
            "peak_memory_bytes": peak_memory_bytes(self.accelerator),
        }

    def text(self, record: dict) -> str:
        """The log line's part: GFLOP/s on a CPU, TFLOP/s on an accelerator; MFU where known; peak memory."""
        per_device = record["tflops_per_device"]
        speed = f"{per_device * 1e3:.2f} GFLOP/s/device" if self.on_cpu else f"{per_device:.1f} TFLOP/s/device"
        mfu = "" if record["mfu"] is None else f" | MFU {record['mfu']:.1%}"
        memory = "peak RSS" if self.on_cpu else "peak mem"
        return f"{speed}{mfu} | {memory} {record['peak_memory_bytes'] / 2**30:.2f} GiB"

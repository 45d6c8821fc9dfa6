"""MFU and peak memory of the training log (megatron/training/utilization.py): the dense bf16 peaks by device name,
the config's override, and the fields and text a log line gets on this CPU."""

import pytest
from deepspeed.accelerator import get_accelerator

from megatron.training.utilization import Utilization, device_peak_flops, table_peak_tflops


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0),  # SXM
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA B200", 2250.0),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_dense_bf16_peak_by_device_name(name, tflops):
    assert table_peak_tflops(name) == tflops


def test_peak_tflops_overrides_the_table_and_a_cpu_has_none():
    assert device_peak_flops("cuda", "NVIDIA H100 80GB HBM3", None) == 989e12
    assert device_peak_flops("cuda", "NVIDIA H100 80GB HBM3", 700.0) == 700e12
    assert device_peak_flops("cuda", "NVIDIA GeForce RTX 4090", None) is None
    assert device_peak_flops("cpu", "cpu", None) is None
    assert device_peak_flops("cpu", "cpu", 0.2) == 0.2e12


def test_log_fields_and_text_on_this_cpu():
    utilization = Utilization(get_accelerator(), 6_000_000, 6_000_000, world_size=2, configured_tflops=None)
    record = utilization.record(tokens_per_sec=10_000.0)
    assert record["flops_per_sec"] == 6e10
    assert record["tflops_per_device"] == pytest.approx(0.03)
    assert record["mfu"] is None and utilization.unknown_device is None
    assert record["peak_memory_bytes"] > 50 * 2**20  # this process's peak resident set: torch alone is more
    text = utilization.text(record)
    assert text.startswith("30.00 GFLOP/s/device | peak RSS ") and "MFU" not in text

    with_peak = Utilization(get_accelerator(), 6_000_000, 6_000_000, world_size=2, configured_tflops=0.1)
    record = with_peak.record(tokens_per_sec=10_000.0)
    assert record["mfu"] == pytest.approx(0.3)
    assert "| MFU 30.0% |" in with_peak.text(record)


def test_recomputation_counts_in_the_flops_but_not_in_the_mfu():
    """Activation checkpointing: 8 FLOPs of hardware work per 6 of model work (a forward recomputed)."""
    utilization = Utilization(get_accelerator(), 8_000_000, 6_000_000, world_size=1, configured_tflops=0.1)
    record = utilization.record(tokens_per_sec=10_000.0)
    assert record["tflops_per_device"] == pytest.approx(0.08)
    assert record["mfu"] == pytest.approx(0.6)

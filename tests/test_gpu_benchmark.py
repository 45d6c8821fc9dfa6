"""benchmarks/gpu_pattention.py on a machine without CUDA: one line saying why on stderr and exit status 2
(nothing measured), before it imports Triton, DeepSpeed or the model. On a GPU machine it runs for real
(`make bench-gpu`), so there this test is skipped. It and benchmarks/max_micro_batch.py measure with the
allocator settings training uses."""

import importlib
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the benchmark would run for real")
def test_without_cuda_it_says_so_in_one_line_and_exits_2():
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_pattention"], cwd=REPO, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "benchmarks.gpu_pattention: needs a CUDA device (torch.cuda.is_available() is False); nothing measured"]


def test_it_imports_nothing_cuda_specific_at_module_load():
    code = ("import sys, benchmarks.gpu_pattention; "
            "print(sorted(m for m in ('triton', 'deepspeed', 'megatron.model.pattention.tiles_triton') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                            check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("module", ["benchmarks.gpu_pattention", "benchmarks.max_micro_batch"])
def test_it_measures_with_the_allocator_settings_training_uses(monkeypatch, module):
    """Issue 46, item 6: both benchmarks measured with the allocator's defaults, not the expandable segments every
    CUDA rank gets (megatron/runtime/entry.py), so their memory figures were not training's. What the environment
    holds at the benchmark's first device call (here stopped there) is what the allocator reads."""
    from megatron.runtime.entry import ALLOCATOR_VARIABLES, allocator_settings

    benchmark = importlib.import_module(module)
    for name in ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def first_device_call(*args, **kwargs):
        seen.update({name: os.environ.get(name) for name in ALLOCATOR_VARIABLES})
        raise InterruptedError("stopped at the first device call")

    monkeypatch.setattr(sys, "argv", [module])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(benchmark, "unavailable_reason", lambda: None, raising=False)  # gpu_pattention: Triton too
    monkeypatch.setattr(torch.cuda, "get_device_name", first_device_call)  # gpu_pattention's first
    monkeypatch.setattr(benchmark, "measure", first_device_call, raising=False)  # max_micro_batch's first
    with pytest.raises(InterruptedError):
        benchmark.main()
    training = allocator_settings("cuda", {})
    assert training and seen == {name: training.get(name) for name in ALLOCATOR_VARIABLES}

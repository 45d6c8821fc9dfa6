"""benchmarks/gpu_pattention.py on a machine without CUDA: one line saying why on stderr and exit status 2
(nothing measured), before it imports Triton, DeepSpeed or the model. On a GPU machine it runs for real
(`make bench-gpu`), so there this test is skipped."""

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

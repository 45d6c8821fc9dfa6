"""`deterministic: true` reaches every rank: torch's deterministic algorithms on, and the fixed cuBLAS workspace
that CUDA's GEMMs need for the same bits every run (on a GPU the embedding's and attention's backward otherwise
add in whatever order their threads arrive; benchmarks/gpu_check.py compares a stopped and resumed run under
it bitwise on a GPU). The default is off: tests/test_rank_failure.py checks both ranks say so."""

from __future__ import annotations

import pytest

from tests.launch_checks import assert_ranks_joined, run_rank_check

pytestmark = pytest.mark.slow


def test_deterministic_turns_on_deterministic_kernels_on_every_rank(demo_data):
    result = run_rank_check(demo_data, "deterministic=true")
    assert_ranks_joined(result, world_size=2)
    assert result.stdout.count("deterministic kernels True, cuBLAS workspace :4096:8") == 2, result.stdout

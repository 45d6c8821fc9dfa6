"""pyflakes' checks through ruff (pyproject.toml's [tool.ruff.lint]) over the whole project: undefined and unused
names. Code no CPU test runs (the GPU benchmarks, rare error paths) otherwise fails only where it runs: a name
removed in a refactor left benchmarks/gpu_pattention.py failing on the first GPU lease after it."""

import subprocess
import sys

from tests.conftest import REPO


def test_no_undefined_or_unused_names():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr

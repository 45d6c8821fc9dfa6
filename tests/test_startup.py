"""megatron/host/startup.py: entry points import torch and DeepSpeed with the garbage collector paused, then leave it
running, never to walk what they imported."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

from megatron.host.startup import collector_paused
from tests.conftest import REPO

ENTRY_POINTS = ("deepy.py", "train.py", "eval.py", "generate.py", "cluster_check.py", "tools/grow_checkpoint.py",
                "tools/progressive_scaling.py")


def test_the_collector_is_off_during_the_imports_and_on_after_with_what_they_made_frozen():
    frozen = gc.get_freeze_count()
    with collector_paused():
        assert not gc.isenabled()
        made = [[] for _ in range(1000)]
    assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(made)


def test_an_import_that_fails_leaves_the_collector_running():
    with pytest.raises(ImportError), collector_paused():
        import a_module_that_does_not_exist  # noqa: F401
    assert gc.isenabled()


def test_a_collector_switched_off_before_stays_off():
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_every_entry_point_imports_with_the_collector_paused_and_leaves_it_running():
    """Each script's module level (not its main) in one fresh process, in turn: the collector runs afterwards, and
    the first one froze torch's and DeepSpeed's objects (hundreds of thousands), each later one at least its own."""
    code = """
import gc, json, runpy, sys
seen = []
for script in sys.argv[1:]:
    frozen = gc.get_freeze_count()
    runpy.run_path(script, run_name="imported")
    seen.append([script, gc.isenabled(), gc.get_freeze_count() - frozen])
print(json.dumps(seen))
"""
    result = subprocess.run([sys.executable, "-c", code, *ENTRY_POINTS], cwd=REPO, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert [script for script, _, _ in seen] == list(ENTRY_POINTS)
    assert all(enabled for _, enabled, _ in seen), seen
    assert seen[0][2] > 200_000 and all(frozen > 0 for _, _, frozen in seen), seen

"""DeepSpeed's compiled ops are cached per Python environment, and a
training rank builds none it does not use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.host.extension_cache import (
    VARIABLE,
    environment_cache,
    use_environment_cache,
)
from tests.conftest import REPO


def test_the_cache_is_this_environments_unless_the_user_chose_one(monkeypatch, tmp_path):
    monkeypatch.delenv(VARIABLE, raising=False)
    ours = environment_cache(Path(sys.prefix), Path.home())  # in the environment, or beside the user's cache
    assert ours == Path(sys.prefix) / "torch_extensions" or ours.parent == Path.home() / ".cache" / "torch_extensions"
    assert use_environment_cache() == ours and os.environ[VARIABLE] == str(ours)
    monkeypatch.setenv(VARIABLE, str(tmp_path))
    assert use_environment_cache() == tmp_path


def test_a_read_only_environment_gets_a_folder_of_its_own_in_the_users_cache(tmp_path):
    """The Docker image's environment belongs to root while its user runs the ranks: the cache goes elsewhere."""
    import subprocess as run

    prefix = tmp_path / "venv"
    prefix.mkdir()
    if os.geteuid() == 0:  # root writes anywhere but on a read-only file system
        run.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(prefix)], check=True)
    else:
        prefix.chmod(0o555)
    try:
        cache = environment_cache(prefix, tmp_path / "home")
    finally:
        if os.geteuid() == 0:
            run.run(["umount", "--lazy", str(prefix)], check=True)
    assert cache.parent == tmp_path / "home" / ".cache" / "torch_extensions" and cache.name.startswith("venv-")
    assert environment_cache(tmp_path, tmp_path / "home") == tmp_path / "torch_extensions"


def test_deepy_sets_it_for_what_it_launches_and_neither_side_patches_torchs_builds():
    """No start compiles through torch's FileBaton (a rank marks DeepSpeed's CPU collectives op unavailable: the
    test below), so neither deepy.py nor a rank's preparation patches it or keeps locks of its own in the cache."""
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    code = ("import os, sys, deepy; from torch.utils.file_baton import FileBaton; shipped = FileBaton.try_acquire; "
            "from megatron.config import load_config; from megatron.runtime.entry import _prepare_process; "
            "from megatron.runtime.settings import RuntimeSettings; deepy.main([]); "
            "print('cache:', os.environ['TORCH_EXTENSIONS_DIR']); "
            "_prepare_process(RuntimeSettings.from_config(load_config([sys.argv[1]], ['data_path=d']))); "
            "print('untouched:', FileBaton.try_acquire is shipped)")
    result = subprocess.run([sys.executable, "-c", code, str(REPO / "tests" / "tiny.yml")], cwd=REPO, env=env,
                            capture_output=True, text=True)
    said = dict(line.split(": ", 1) for line in result.stdout.splitlines() if line.startswith(("cache:", "untouched:")))
    assert said == {"cache": str(environment_cache(Path(sys.prefix), Path.home())), "untouched": "True"}, (
        result.stdout + result.stderr)


def rank_start(config: Path, extensions: str) -> tuple[bool, list[str], list[str]]:
    """A training rank's start (megatron/runtime): whether DeepSpeed's collectives hold a C++ op, what was built
    into the op cache, and the /dev/shm buffers of this port."""
    import deepspeed.comm.comm as ds_comm

    from megatron.config import load_config
    from megatron.runtime.process_group import initialize_distributed

    os.environ[VARIABLE] = extensions
    initialize_distributed(load_config([config], ["num_gpus=2"]))
    built = sorted(path.name for path in Path(extensions).iterdir()) if Path(extensions).is_dir() else []
    buffers = sorted(path.name for path in Path("/dev/shm").glob(f"deepspeed_*_{os.environ['MASTER_PORT']}_*"))
    return ds_comm.cdb.shm_comm_op is not None, built, buffers


@pytest.mark.slow
def test_a_rank_builds_and_maps_no_op_for_deepspeeds_inference_collectives(tmp_path):
    """DeepSpeed would compile a C++ op at the first start of every environment, and map a /dev/shm buffer per rank,
    for its inference kernels' all-reduce alone; a training rank's collectives are torch.distributed's."""
    from tests.distributed import run_on_ranks

    for has_op, built, buffers in run_on_ranks(2, rank_start, REPO / "tests" / "tiny.yml", str(tmp_path / "ops")):
        assert (has_op, built, buffers) == (False, [], [])

"""DeepSpeed's compiled op is cached per Python environment; its build locks:
tests/test_build_locks.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_deepy_sets_it_for_what_it_launches(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    code = "import os, deepy; deepy.main([]); print(os.environ['TORCH_EXTENSIONS_DIR'])"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.stdout.strip().splitlines()[-1] == str(environment_cache(Path(sys.prefix), Path.home()))


def test_a_first_cpu_start_says_it_compiles(tmp_path):
    from megatron.host.extension_cache import compile_note

    note = compile_note(tmp_path, "cpu")
    assert note.startswith(f"note: DeepSpeed compiles its CPU communication op into {tmp_path} before the ranks")
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    assert compile_note(tmp_path, "cpu") is None and compile_note(tmp_path / "none", "cuda") is None

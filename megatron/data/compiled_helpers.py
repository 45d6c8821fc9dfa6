"""Compile ``helpers.cpp`` on first use and load it; ``None`` (NumPy fallback) when no compiler works.

The shared library is cached under ``$TOKENFORMER_CACHE_DIR`` (default
``~/.cache/tokenformer-neox``) in a directory named by a hash of the source,
the Python ABI and the pybind11 version, so an edited source or another
interpreter gets its own build. A file lock makes one process compile while
concurrent ones (ranks, jobs) wait and then load its result.

Set ``TOKENFORMER_DATA_HELPERS=numpy`` to skip them.

    python -m megatron.data.compiled_helpers   # build now (e.g. on a login node) and report
"""

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from functools import lru_cache
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers.cpp")
_COMPILE_TIMEOUT_SECONDS = 300


def cache_dir() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "tokenformer-neox")
    root = os.environ.get("TOKENFORMER_CACHE_DIR") or default
    return os.path.join(root, "helpers")


def _compile_command(output: str) -> list[str]:
    import pybind11

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    return [
        compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
        f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
        SOURCE, "-o", output,
    ]


def library_path() -> str:
    """Where the build for this source, interpreter and pybind11 lives."""
    import pybind11

    with open(SOURCE, "rb") as stream:
        digest = hashlib.sha256(stream.read())
    digest.update(f"{sys.implementation.cache_tag} {pybind11.__version__}".encode())
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return os.path.join(cache_dir(), digest.hexdigest()[:16], "helpers" + suffix)


def _build(path: str) -> None:
    """Compile to a temporary name and rename, under a lock, unless another process already did."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(path):
            return
        temporary = f"{path}.tmp{os.getpid()}"
        result = subprocess.run(
            _compile_command(temporary), capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_SECONDS
        )
        if result.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE} failed:\n{result.stderr[-2000:]}")
        os.replace(temporary, path)


def _import(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=1)
def load_helpers() -> ModuleType | None:
    """The compiled module, built if needed; None (logged once) when it cannot be built or loaded."""
    if os.environ.get("TOKENFORMER_DATA_HELPERS") == "numpy":
        return None
    try:
        path = library_path()
        if not os.path.isfile(path):
            _build(path)
        return _import(path)
    except (ImportError, OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("C++ data helpers unavailable, using the slower NumPy builders: %s", error)
        return None


if __name__ == "__main__":
    helpers = load_helpers()
    print(f"compiled helpers: {library_path()}" if helpers else "compiled helpers unavailable; see the warning above")
    sys.exit(0 if helpers else 1)

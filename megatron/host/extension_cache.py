"""The cache DeepSpeed compiles the ops a run needs into (ZeRO-Offload's CPU Adam, say): one per Python environment.

torch keeps compiled extensions in TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions, shared by every
environment of the user: two checkouts with different torch builds would rebuild the op in turn on every
start, a build of minutes each time. So every entry point (deepy.py, and each rank for launches without it) sets it to
`<environment>/torch_extensions` unless the user set it (a folder of the environment's own in the user's cache
where the environment is read-only).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

VARIABLE = "TORCH_EXTENSIONS_DIR"


def environment_cache(prefix: Path, home: Path) -> Path:
    """This Python environment's cache: inside it (`prefix`/torch_extensions) where this user may write there,
    else a folder of its own in the user's cache (a read-only environment: a Docker image's, a cluster's shared
    one)."""
    inside = prefix / "torch_extensions"
    try:
        inside.mkdir(exist_ok=True)
        with tempfile.TemporaryFile(dir=inside):
            return inside
    except OSError:
        tag = hashlib.sha1(str(prefix.resolve()).encode()).hexdigest()[:10]
        return home / ".cache" / "torch_extensions" / f"{prefix.name}-{tag}"


def use_environment_cache() -> Path:
    """TORCH_EXTENSIONS_DIR: the user's, or this Python environment's own (set for this process and its
    children)."""
    if not os.environ.get(VARIABLE):
        os.environ[VARIABLE] = str(environment_cache(Path(sys.prefix), Path.home()))
    return Path(os.environ[VARIABLE])

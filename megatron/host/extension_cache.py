"""The cache DeepSpeed compiles its CPU communication op into: one per Python environment.

torch keeps compiled extensions in TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions, shared by every
environment of the user: two checkouts with different torch builds would rebuild the op in turn on every
start, a build of minutes each time. So every entry point (deepy.py, and each rank for launches without it) sets it to
`<environment>/torch_extensions` unless the user set it (a folder of the environment's own in the user's cache
where the environment is read-only).

A build lock left in it by an interrupted start is removed before launching (build_locks.py).
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


CPU_COMM_OP = "deepspeed_shm_comm"


def build_cpu_comm_op() -> Path | None:
    """Compile DeepSpeed's CPU communication op into this environment's cache now, so that no start compiles it
    (the CPU image's build does: its containers start fresh, and would each compile it again); the op's folder, or
    None with a CUDA build of torch, whose runs use NCCL instead."""
    import torch

    if torch.version.cuda is not None:
        return None
    cache = use_environment_cache()
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ShareMemCommBuilder().load(verbose=False)
    return cache / CPU_COMM_OP


def compile_note(cache: Path, device: str) -> str | None:
    """What to say before a CPU start that will compile DeepSpeed's communication op first (a long silence
    otherwise); None when it is built, or on an accelerator (which does not use it)."""
    if device != "cpu" or (cache / CPU_COMM_OP / f"{CPU_COMM_OP}.so").is_file():
        return None
    return (f"note: DeepSpeed compiles its CPU communication op into {cache} before the ranks start (1-5 minutes, "
            "once for this Python environment)")


if __name__ == "__main__":
    built = build_cpu_comm_op()
    print(f"DeepSpeed's CPU communication op is in {built}" if built else
          "a CUDA build of torch: DeepSpeed's CPU communication op is not needed")

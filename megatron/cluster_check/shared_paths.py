"""Are `save`, `load`, the datasets and the tokenizer the same files on every node?

A training job whose `save` is a node-local folder on some nodes writes checkpoints that no later job can
resume, and ranks that read different data under one path train on different corpora: both are silent until
much later. Two checks, both collective:

- a directory (save, load): rank 0 writes a random nonce into it and every rank reads it back; a rank that
  finds another value, or nothing, sees another directory under that path. `save` must also take a file from
  every rank (the ranks write their own checkpoint shards). A `load` that rank 0 cannot write into is compared
  by its listing and `latest` instead.
- a file (each dataset's .idx and .bin, the tokenizer): every rank digests its size and SAMPLED_BLOCKS MiB
  spread over it (a small file whole) and the digests are compared with rank 0's. Not the whole file: an .idx
  of GBs, read by every rank of a node at once, would take minutes, and a .bin may be terabytes.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

import torch.distributed as dist

from megatron.cluster_check.ranks import Ranks, gather
from megatron.cluster_check.report import SectionResult

NONCE_PREFIX = ".cluster_check_nonce_"
SAMPLED_BLOCKS = 8
BLOCK_BYTES = 2**20


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _can_write(folder: Path, name: str) -> str | None:
    """Why this rank cannot create a file in `folder`; None if it can (the file is removed again)."""
    probe = folder / name
    try:
        probe.write_text("probe", encoding="utf-8")
        probe.unlink()
    except OSError as error:
        return error.strerror or type(error).__name__
    return None


def _listing(folder: Path) -> str:
    """The names and sizes at the top of `folder`, and what `latest` names: equal on every rank for one shared
    directory."""
    try:
        entries = sorted((p.name, p.stat().st_size if p.is_file() else -1) for p in folder.iterdir())
    except OSError as error:
        return f"unreadable: {error.strerror}"
    return repr((entries, _read(folder / "latest")))


def check_directory(result: SectionResult, ranks: Ranks, key: str, value: str, tag: str, written: bool) -> bool:
    """Collective: is directory `key` = `value` one directory on every rank? `written`: every rank must be able to
    write into it (`save`). Findings go into `result`; returns whether it passed."""
    folder = Path(value)
    rank = dist.get_rank()
    nonce_name = f"{NONCE_PREFIX}{tag}"
    problem = None
    if rank == 0:
        try:
            if written:
                folder.mkdir(parents=True, exist_ok=True)
            (folder / nonce_name).write_text(secrets.token_hex(16), encoding="utf-8")
        except OSError as error:
            problem = error.strerror or type(error).__name__
    problem = gather(problem)[0]
    if written and problem is not None:
        result.fail(ranks.who(0), f"{key} = {value} cannot be written by rank 0 ({problem})",
                    f"make {value} writable on {ranks.hosts_by_rank[0]} or choose another {key}")
        return False
    wrote = problem is None
    dist.barrier()
    seen = _read(folder / nonce_name) if wrote else _listing(folder)
    writable = _can_write(folder, f"{nonce_name}_rank{rank}") if written else None
    observations = gather((seen, writable))
    if rank == 0 and wrote:
        (folder / nonce_name).unlink(missing_ok=True)
    expected = observations[0][0]
    passed = True
    for other, (seen_there, cannot_write) in enumerate(observations):
        if seen_there != expected:
            what = ("does not hold the file rank 0 wrote there" if wrote and seen_there is None else
                    "holds another file where rank 0 wrote its nonce" if wrote else
                    "lists other files than on rank 0")
            result.fail(ranks.who(other), f"{key} = {value} {what}: it is not the same directory as on "
                        f"{ranks.who(0)}", f"mount the same shared filesystem at {value} on "
                        f"{ranks.hosts_by_rank[other]} (a node-local folder or a mount missing on that node)")
            passed = False
        elif cannot_write:
            result.fail(ranks.who(other), f"{key} = {value} is not writable there ({cannot_write})",
                        f"fix the permissions or the mount of {value} on {ranks.hosts_by_rank[other]}")
            passed = False
    return passed


def file_digest(path: Path) -> str:
    """sha256 of the file's size and of SAMPLED_BLOCKS blocks evenly spread from its first byte to its last (the
    whole file when it is no larger); 'unreadable: REASON' when it cannot be read (a missing file included)."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            digest = hashlib.sha256(str(size).encode())
            last_start = max(0, size - BLOCK_BYTES)
            starts = sorted({last_start * block // (SAMPLED_BLOCKS - 1) for block in range(SAMPLED_BLOCKS)})
            for start in starts:
                handle.seek(start)
                digest.update(handle.read(BLOCK_BYTES))
            return digest.hexdigest()
    except OSError as error:
        return f"unreadable: {error.strerror}"


def check_files(result: SectionResult, ranks: Ranks, files: list[tuple[str, Path]]) -> bool:
    """Collective: is each (key, path) the same file on every rank as on rank 0? Findings go into `result`;
    returns whether all were."""
    digests = gather([file_digest(path) for _, path in files])
    passed = True
    for index, (key, path) in enumerate(files):
        expected = digests[0][index]
        differing = [rank for rank, d in enumerate(digests) if d[index] != expected]
        if not differing:
            continue
        passed = False
        for host in dict.fromkeys(ranks.hosts_by_rank[r] for r in differing):
            on_host = [r for r in differing if ranks.hosts_by_rank[r] == host]
            result.fail(ranks.name(on_host), f"{key}: {path} is another file than on {ranks.who(0)} (sha256 "
                        f"{digests[on_host[0]][index][:12]} where rank 0 has {expected[:12]})",
                        f"give {host} the same {path} (copy it again, or put the data on the shared filesystem)")
    return passed

"""Tools write into a new or empty directory only, so nothing they write can replace what is already there
(a run's `latest`, another export's weights)."""

import shutil
from pathlib import Path


def require_new_or_empty(directory: str | Path, option: str = "--save") -> Path:
    """`directory` as a Path; FileExistsError naming `option` if it exists and is not an empty directory (and
    naming what it holds when `ls` would show nothing: hidden entries only), NotADirectoryError if a file on
    its way would keep it from being created (found before any work, not when the first file is written)."""
    directory = Path(directory)
    blocker = next((folder for folder in directory.absolute().parents if folder.exists()), None)
    if not directory.exists() and blocker is not None and not blocker.is_dir():
        raise NotADirectoryError(f"{option} {directory} cannot be created: {blocker} is a file, not a directory; "
                                 "choose another path")
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        hidden = sorted(entry.name for entry in directory.iterdir()) if directory.is_dir() else []
        only_hidden = hidden and all(name.startswith(".") for name in hidden)
        shown = f"; it holds hidden entries only: {', '.join(hidden)}" if only_hidden else ""
        raise FileExistsError(f"{option} {directory} exists and is not empty; choose a new or empty directory "
                              f"(nothing is overwritten){shown}")
    return directory


def remove_interrupted_writes(directory: Path, staging_prefix: str) -> list[str]:
    """When `directory` holds nothing but staging folders (`staging_prefix`...) of a write that was killed
    before it committed, remove them: incomplete by construction, they would only block the re-run. Returns
    their names."""
    if not directory.is_dir():
        return []
    entries = list(directory.iterdir())
    if not entries or not all(entry.is_dir() and entry.name.startswith(staging_prefix) for entry in entries):
        return []
    for entry in entries:
        shutil.rmtree(entry)
    return sorted(entry.name for entry in entries)

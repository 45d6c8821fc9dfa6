"""Tools write into a new or empty directory only, so nothing they write can replace what is already there
(a run's `latest`, another export's weights)."""

from pathlib import Path


def require_new_or_empty(directory: str | Path, option: str = "--save") -> Path:
    """`directory` as a Path; FileExistsError naming `option` if it exists and is not an empty directory."""
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise FileExistsError(f"{option} {directory} exists and is not empty; choose a new or empty directory "
                              "(nothing is overwritten)")
    return directory

"""Give a launch test the system tools and Python packages it runs for real, installing what is missing.

The SLURM and MPI tests start real daemons and launchers. On a fresh machine
(CI runs as root) they install Debian's packages once; afterwards they are found.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _run(command: list[str]) -> None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")


def require_debian_packages(commands: dict[str, str]) -> None:
    """Install the package of every command (command -> Debian package) not on PATH; skip without root."""
    missing = sorted({package for command, package in commands.items() if not shutil.which(command)})
    if not missing:
        return
    if os.geteuid() != 0:
        pytest.skip(f"needs Debian packages {' '.join(missing)}: apt-get install -y {' '.join(missing)} as root")
    _run(["apt-get", "update", "-qq"])
    _run(["apt-get", "install", "-y", "-qq", *missing])


def require_python_packages(module: str, requirements: str) -> None:
    """pip-install a requirements file (relative to the repository) when `module` is not importable."""
    if importlib.util.find_spec(module) is None:
        _run([sys.executable, "-m", "pip", "install", "--quiet", "-r", str(REPO / requirements)])

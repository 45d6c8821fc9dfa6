"""The Dockerfile, checked without a Docker engine: hadolint, pins that agree with requirements/, and a pip dry run.

The dry run resolves the image's requirement set against PyPI alone (this
machine's local wheel mirrors are switched off), as `docker build` would, and
the CUDA version of the torch it picks must be the base image's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib

from tests.conftest import REPO

DOCKERFILE = REPO / "Dockerfile"
REQUIREMENTS = REPO / "requirements"
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line of a requirements file, following `-r` includes."""
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            found.update(pins(path.parent / line[3:].strip()))
        elif line:
            match = PIN.match(line)
            assert match, f"{path.name}: {line!r} is not pinned as name==version"
            found[canonical(match[1])] = match[2]
    return found


def pyproject_pins(specifiers: list[str]) -> dict[str, str]:
    return {canonical(match[1]): match[2] for match in map(PIN.match, specifiers)}


def image_requirement_files() -> list[str]:
    """The requirements files the GPU image installs: the default of the Dockerfile's REQUIREMENTS argument."""
    return re.search(r'^ARG REQUIREMENTS="([^"]+)"$', DOCKERFILE.read_text(), re.MULTILINE)[1].split()


def test_hadolint_passes():
    hadolint = Path(sysconfig.get_path("scripts")) / "hadolint"
    result = subprocess.run([str(hadolint), str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_pin_agrees_across_requirements_pyproject_and_the_image():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert pyproject_pins(project["dependencies"]) == pins(REQUIREMENTS / "requirements.txt")
    extras = project["optional-dependencies"]
    # requirements-gpu.txt is the core set (PyPI's torch is the CUDA build), so it has no extra of its own; nor has
    # requirements-pip.txt, the installer, which pip installs before the rest.
    files = {path.name for path in REQUIREMENTS.glob("requirements-*.txt")} - {"requirements-gpu.txt",
                                                                               "requirements-pip.txt"}
    assert files == {f"requirements-{extra}.txt" for extra in extras}, "each requirements-X.txt is extra X"
    for extra, specifiers in extras.items():
        assert pyproject_pins(specifiers) == pins(REQUIREMENTS / f"requirements-{extra}.txt"), extra
    versions: dict[str, set[str]] = {}
    for path in REQUIREMENTS.glob("*.txt"):
        for name, version in pins(path).items():
            versions.setdefault(name, set()).add(version)
    assert not {name: v for name, v in versions.items() if len(v) > 1}
    image_files = sorted(image_requirement_files())
    assert image_files == ["requirements-gpu.txt", "requirements-logging.txt", "requirements-mpi.txt"]
    assert not re.search(r"pip install[^\n]*==", DOCKERFILE.read_text()), "pin in requirements/, not the Dockerfile"


def test_image_builds_the_helpers_runs_as_a_user_and_leaves_local_state_out():
    text = DOCKERFILE.read_text()
    module = re.search(r"python -m (megatron\.\S+)", text)[1]
    assert (REPO / (module.replace(".", "/") + ".py")).is_file(), module
    compiled = re.search(r"python -m compileall -q ([^\\&]+)", text)[1].split()  # the project's bytecode, built in
    assert "megatron" in compiled and all(list(REPO.glob(path)) for path in compiled), compiled
    assert re.findall(r"^USER (\S+)$", text, re.MULTILINE)[-1].split(":")[0] not in ("root", "0")
    assert f"python{sys.version_info.major}.{sys.version_info.minor} " in text, "the image's Python is the tested one"
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", "data", "checkpoints"} <= ignored


@pytest.mark.network
def test_pip_resolves_the_image_requirements_with_the_base_images_cuda(tmp_path):
    report = tmp_path / "report.json"
    files = [arg for name in image_requirement_files() for arg in ("-r", str(REQUIREMENTS / name))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
         *files],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert result.returncode == 0, result.stderr
    installs = json.loads(report.read_text())["install"]
    resolved = {canonical(item["metadata"]["name"]): item["metadata"] for item in installs}
    for name in image_requirement_files():
        for package, version in pins(REQUIREMENTS / name).items():
            assert resolved[package]["version"] == version, package
    base_cuda = re.search(r"^ARG BASE_IMAGE=nvidia/cuda:(\d+)\.", DOCKERFILE.read_text(), re.MULTILINE)[1]
    torch_cuda = {m[1] for dep in resolved["torch"]["requires_dist"] if (m := re.search(r"-cu(\d+)\b", dep))}
    assert torch_cuda == {base_cuda}, resolved["torch"]["requires_dist"]


def test_cluster_docs_show_the_commands_the_image_test_runs():
    from tests import docker_image

    text = (REPO / "docs" / "cluster.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    shown = " ".join(" ".join(block.replace("\\\n", " ").split()) for block in blocks)
    for command in docker_image.documented_commands():
        assert " ".join(command.split()) in shown, f"docs/cluster.md does not show: {command}"
    assert docker_image.CONTAINERS_CONF in text


def test_the_cpu_image_is_the_same_dockerfile_with_build_arguments():
    from tests import docker_image

    text = DOCKERFILE.read_text()
    declared = set(re.findall(r"^ARG (\w+)", text, re.MULTILINE))
    command = docker_image.build("image")
    given = {value.split("=")[0] for flag, value in zip(command, command[1:]) if flag == "--build-arg"}
    assert given == {"BASE_IMAGE", "REQUIREMENTS", "PIP_OPTIONS"} <= declared
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.MULTILINE)
    for name in docker_image.CPU_REQUIREMENTS.split():
        assert (REQUIREMENTS / name).is_file(), name
    assert "requirements-gpu.txt" not in docker_image.CPU_REQUIREMENTS

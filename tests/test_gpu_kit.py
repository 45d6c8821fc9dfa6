"""benchmarks/gpu_kit.py: the wheels the borrowed GPU machine lacks (make gpu-kit), and their offline install."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement

from benchmarks import gpu_kit
from benchmarks.gpu_kit import (CARRIED_OVER_THE_IMAGE, KitError, applies_on_target, build, check_kit, install,
                                kit_requirements)

REPO = Path(__file__).resolve().parents[1]
# The GPU machine, written out here again so the kit is checked against an independent reading.
GPU_MACHINE = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    text = (REPO / "requirements" / "requirements.txt").read_text()
    return {normalised(name): version for name, version in re.findall(r"^([\w.-]+)==(\S+)", text, re.MULTILINE)}


def image() -> set[str]:
    lines = (REPO / "benchmarks" / "gpu_image_packages.txt").read_text().splitlines()
    return {normalised(line) for line in lines if line and not line.startswith("#")}


def dependencies(name: str) -> set[str]:
    """The installed `name`'s dependencies on the GPU machine, extras left out."""
    found = set()
    for line in importlib.metadata.requires(name) or []:
        requirement, _, marker = line.partition(";")
        if not marker or Marker(marker).evaluate(GPU_MACHINE):
            found.add(normalised(re.match(r"[\w.-]+", requirement.strip()).group()))
    return found


def test_kit_is_the_pins_the_image_lacks_and_their_dependencies_it_lacks():
    kit, pinned, image_names = kit_requirements(), pins(), image()
    missing = {name: version for name, version in pinned.items() if name not in image_names}
    assert missing and missing.items() <= kit.items()
    assert set(kit) & image_names == set(CARRIED_OVER_THE_IMAGE)
    for name in set(kit) - set(pinned):
        assert any(name in dependencies(parent) for parent in kit), f"{name} is no kit package's dependency"
    closure, pending = set(), list(missing)
    while pending:
        name = pending.pop()
        if name not in closure:
            closure.add(name)
            pending += dependencies(name) - image_names
    assert kit == {name: importlib.metadata.version(name) for name in sorted(closure | set(CARRIED_OVER_THE_IMAGE))}
    assert {"deepspeed", "pydantic"} <= set(kit)


@pytest.mark.parametrize("requirement, applies", [
    ("hjson", True),
    ('backport; python_version < "3.12"', False),  # True for the 3.11 running these tests
    ('modern; python_version >= "3.12"', True),
    ('devtool; extra == "dev"', False),
    ('pywin; sys_platform == "win32"', False),
    ('linux-only; platform_system == "Linux" and platform_machine == "x86_64"', True),
])
def test_markers_are_evaluated_for_the_gpu_machine_without_extras(requirement, applies):
    assert applies_on_target(Requirement(requirement)) is applies


def test_a_package_not_installed_is_one_line_naming_make_install(tmp_path, monkeypatch):
    (tmp_path / "requirements.txt").write_text("# core\nno-such-package-here==1.0\n")
    (tmp_path / "image.txt").write_text("# none\n")
    monkeypatch.setattr(gpu_kit, "REQUIREMENTS", tmp_path / "requirements.txt")
    monkeypatch.setattr(gpu_kit, "IMAGE_PACKAGES", tmp_path / "image.txt")
    with pytest.raises(KitError, match=r"^no-such-package-here .*not installed.*`make install`$"):
        kit_requirements()


def test_check_kit_names_what_is_wrong(tmp_path):
    kit = {"hjson": "3.1.0", "zstandard": "0.25.0"}
    (tmp_path / "hjson-3.1.0-py3-none-any.whl").write_bytes(b"")
    with pytest.raises(KitError, match="zstandard"):
        check_kit(tmp_path, kit)
    (tmp_path / "zstandard-0.24.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"")
    with pytest.raises(KitError, match="0.24.0"):
        check_kit(tmp_path, kit)
    (tmp_path / "zstandard-0.24.0-cp312-cp312-manylinux_2_17_x86_64.whl").rename(
        tmp_path / "zstandard-0.25.0-cp312-cp312-manylinux_2_17_x86_64.whl")
    assert len(check_kit(tmp_path, kit)) == 2
    os.truncate(tmp_path / "hjson-3.1.0-py3-none-any.whl", gpu_kit.MAX_KIT_BYTES)  # sparse: no disk used
    with pytest.raises(KitError, match="MiB"):
        check_kit(tmp_path, kit)


def test_install_without_a_kit_names_make_gpu_kit(tmp_path):
    (tmp_path / "empty").mkdir()
    for kit in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(KitError, match="make gpu-kit"):
            install(kit, tmp_path / "site")


@pytest.mark.network
def test_a_failed_build_leaves_the_previous_kit_untouched(tmp_path, monkeypatch):
    out = tmp_path / "kit"
    out.mkdir()
    (out / "hjson-3.1.0-py3-none-any.whl").write_text("the previous kit")
    monkeypatch.setattr(gpu_kit, "kit_requirements", lambda: {"hjson": "99.0.0"})
    with pytest.raises(KitError, match="hjson==99.0.0"):
        build(out)
    assert [path.name for path in tmp_path.iterdir()] == ["kit"]  # no staging folder left
    assert [path.name for path in out.iterdir()] == ["hjson-3.1.0-py3-none-any.whl"]
    assert (out / "hjson-3.1.0-py3-none-any.whl").read_text() == "the previous kit"


IMPORT_CHECK = """
import deepspeed, pydantic
from deepspeed.git_version_info import installed_ops
print(deepspeed.__version__, pydantic.VERSION, deepspeed.__file__, pydantic.__file__, sorted(
    op for op, built in installed_ops.items() if built), sep="\\n")
"""


@pytest.mark.network
@pytest.mark.slow
def test_built_kit_installs_offline_and_deepspeed_imports_from_it(built_gpu_kit, tmp_path):
    kit = kit_requirements()
    wheels = check_kit(built_gpu_kit, kit)
    assert len(wheels) == len(kit) and wheels == sorted(built_gpu_kit.glob("*.whl"))
    assert sum(wheel.stat().st_size for wheel in wheels) < 48 * 2**20
    assert (built_gpu_kit / "MANIFEST.txt").read_text().startswith("annotated-types==")

    target = install(built_gpu_kit, tmp_path / "site")
    installed = {dist.metadata["Name"].lower().replace("_", "-"): dist.version
                 for dist in importlib.metadata.distributions(path=[str(target)])}
    assert installed == kit
    if sys.version_info[:2] != (3, 12):
        # The compiled wheels are CPython 3.12's: here the pure ones are imported from a site folder of
        # their own, their compiled dependencies (same versions) from this venv.
        pure = tmp_path / "pure"
        pure.mkdir()
        for wheel in wheels:
            if wheel.name.endswith("-none-any.whl"):
                (pure / wheel.name).write_bytes(wheel.read_bytes())
        target = install(pure, tmp_path / "pure-site")
    result = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(target)}, timeout=300)
    assert result.returncode == 0, result.stderr
    deepspeed_version, pydantic_version, deepspeed_file, pydantic_file, ops = result.stdout.splitlines()[-5:]
    assert (deepspeed_version, pydantic_version) == ("0.19.8", kit["pydantic"])
    assert Path(deepspeed_file).is_relative_to(target) and Path(pydantic_file).is_relative_to(target)
    assert ops == "[]", f"ops compiled ahead into the kit's DeepSpeed: {ops}"

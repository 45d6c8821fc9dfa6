"""The GPU kit: wheels of the packages a borrowed CUDA machine lacks for a training run and the GPU tests.

    .venv/bin/python -m benchmarks.gpu_kit build [--out .gpu-kit]    (make gpu-kit)
    .venv/bin/python -m benchmarks.gpu_kit list

That machine has no network and no DeepSpeed, and the repository travels there with at most 64 MiB. The kit
holds the packages of requirements/requirements.txt that its image (benchmarks/gpu_image_packages.txt)
lacks, with their dependencies that it lacks too (installed metadata, markers evaluated for the machine:
CPython 3.12 on Linux x86_64), each at the version this venv runs, so the GPU runs use what the CPU tests
did. There, install() puts them into a site folder, which goes first on sys.path before anything imports
deepspeed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[1]
REQUIREMENTS = REPO / "requirements" / "requirements.txt"
IMAGE_PACKAGES = REPO / "benchmarks" / "gpu_image_packages.txt"
MAX_KIT_BYTES = 48 * 2**20  # leaves the rest of the 64 MiB that travel to the machine to the repository
# The GPU machine, for environment markers and for the wheels pip downloads.
TARGET_MARKERS = {
    "python_version": "3.12", "python_full_version": "3.12.0", "implementation_version": "3.12.0",
    "implementation_name": "cpython", "platform_python_implementation": "CPython",
    "os_name": "posix", "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "extra": "",
}
TARGET_WHEELS = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
                 "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                 "--platform", "manylinux2014_x86_64"]
# Published as sdists only and pure Python once no op is compiled ahead (DS_BUILD_OPS=0): built here with
# this venv's torch. DeepSpeed compiles an op on first use, on the machine that uses it.
BUILT_HERE = {"deepspeed": {"DS_BUILD_OPS": "0"}}
# Packages the image has, but in a version nobody read that may be older than a kit package needs: carried at
# this venv's version all the same, first on the path there. An import failure of DeepSpeed would cost a whole
# GPU session; the wheel is small.
CARRIED_OVER_THE_IMAGE = {"typing-extensions": "pydantic 2.14 and pydantic-core 2.50 need >= 4.16.0"}


class KitError(RuntimeError):
    """The kit cannot be made or installed; the message says what to do."""


def applies_on_target(requirement: Requirement) -> bool:
    """Whether `requirement` holds on the GPU machine (no extras asked for), whatever machine runs this."""
    return requirement.marker is None or requirement.marker.evaluate(TARGET_MARKERS)


def pinned_requirements() -> dict[str, str]:
    """Normalised name -> pinned version of requirements/requirements.txt's packages for the GPU machine."""
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        if line.split("#")[0].strip():
            requirement = Requirement(line.split("#")[0])
            pin = [spec.version for spec in requirement.specifier if spec.operator == "=="]
            if len(pin) != 1:
                raise KitError(f"{REQUIREMENTS.name}: {line!r} is not pinned with =="
                               " (the kit carries exact versions)")
            if applies_on_target(requirement):
                pins[canonicalize_name(requirement.name)] = pin[0]
    return pins


def image_packages() -> set[str]:
    """Normalised names of the packages the GPU machine's image has."""
    lines = IMAGE_PACKAGES.read_text().splitlines()
    return {canonicalize_name(line) for line in map(str.strip, lines) if line and not line.startswith("#")}


def installed(name: str) -> importlib.metadata.Distribution:
    """The distribution `name` of this environment, whose metadata gives the kit's dependencies."""
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise KitError(f"{name} (needed in the GPU kit) is not installed in {sys.prefix}: run `make install`") from None


def kit_requirements() -> dict[str, str]:
    """Name -> exact version of every package the kit holds: the pins the image lacks, then their dependencies
    the image lacks, at the versions installed here (the versions the CPU tests ran with), and
    CARRIED_OVER_THE_IMAGE. The image's own packages are not followed: the image holds their dependencies."""
    image, pins = image_packages(), pinned_requirements()
    kit: dict[str, str] = {name: installed(name).version for name in CARRIED_OVER_THE_IMAGE}
    pending = [name for name in pins if name not in image]
    while pending:
        name = pending.pop()
        if name in kit:
            continue
        distribution = installed(name)
        if name in pins and distribution.version != pins[name]:
            raise KitError(f"{name} {distribution.version} is installed but {REQUIREMENTS.name} pins "
                           f"{pins[name]}: run `make install`")
        kit[name] = distribution.version
        for requirement in map(Requirement, distribution.requires or []):
            dependency = canonicalize_name(requirement.name)
            if applies_on_target(requirement) and dependency not in image:
                pending.append(dependency)
    return dict(sorted(kit.items()))


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    """`python -m pip ARGS` of this interpreter; a KitError with pip's last words if it fails."""
    result = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                            env=None if env is None else {**os.environ, **env})
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise KitError(f"pip {args[0]} failed: {last}")


def check_kit(folder: Path, kit: dict[str, str]) -> list[Path]:
    """The wheels in `folder`, after checking there is one per kit package at its version and they fit."""
    wheels = sorted(folder.glob("*.whl"))
    found = {}
    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if name in found:
            raise KitError(f"two wheels of {name} in {folder}: {found[name]} and {version}")
        found[name] = str(version)
    if found != kit:
        wrong = sorted(set(found.items()) ^ set(kit.items()))
        raise KitError(f"the wheels in {folder} do not match the kit; differing name==version: {wrong}")
    total = sum(wheel.stat().st_size for wheel in wheels)
    if total >= MAX_KIT_BYTES:
        raise KitError(f"the kit is {total / 2**20:.1f} MiB, over its {MAX_KIT_BYTES / 2**20:.0f} MiB")
    return wheels


def build(out: Path) -> list[Path]:
    """Writes the kit's wheels and MANIFEST.txt into `out` and returns the wheels. Built in a sibling folder
    first, which replaces `out` only once complete and checked: a failed build leaves `out` as it was."""
    kit = kit_requirements()
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's folder is its owner's only; the kit is an ordinary folder
    try:
        downloads = [f"{name}=={version}" for name, version in kit.items() if name not in BUILT_HERE]
        if downloads:
            pip("download", "--quiet", "--no-deps", "--only-binary=:all:", *TARGET_WHEELS, "--dest", str(staging),
                *downloads)
        for name, env in BUILT_HERE.items():
            if name in kit:
                pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-cache-dir",
                    "--wheel-dir", str(staging), f"{name}=={kit[name]}", env=env)
        wheels = check_kit(staging, kit)
        total = sum(wheel.stat().st_size for wheel in wheels)
        lines = [f"{name}=={version}" for name, version in kit.items()]
        (staging / "MANIFEST.txt").write_text("\n".join([*lines, f"# total {total} bytes"]) + "\n")
    except BaseException:
        shutil.rmtree(staging)
        raise
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return [out / wheel.name for wheel in wheels]


def install(kit: Path, target: Path) -> Path:
    """Installs the kit's wheels into the site folder `target` (no index: the GPU machine has no network) and
    returns it; put it first on sys.path and PYTHONPATH before anything imports deepspeed. The wheels are
    taken as the GPU machine's whatever interpreter runs this, so the kit installs (and is tested) here too."""
    wheels = sorted(kit.glob("*.whl"))
    if not wheels:
        raise KitError(f"no GPU kit in {kit} (no wheels): run `make gpu-kit` on a machine with the package index")
    pip("install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
        *TARGET_WHEELS, "--target", str(target), *map(str, wheels))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_kit", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="write the kit's wheels").add_argument("--out", type=Path,
                                                                            default=REPO / ".gpu-kit")
    commands.add_parser("list", help="print name==version of every package the kit holds")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            print("\n".join(f"{name}=={version}" for name, version in kit_requirements().items()))
        else:
            wheels = build(args.out)
            print("\n".join(wheel.name for wheel in wheels))
            total = sum(wheel.stat().st_size for wheel in wheels)
            print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.out}")
    except KitError as error:
        print(f"gpu_kit: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

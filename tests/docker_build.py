"""The CPU image's build for tests/test_docker_image.py, and the steps run in it, in a process of its own.

The build mostly waits on the network and the disk (Debian's archive, PyPI, unpacking), so when the session will
run the image test, tests/conftest.py starts it as the session begins and the rest of the suite runs meanwhile;
the test then waits for it (or, run alone, starts it itself). The process installs podman, runc and debootstrap
if missing, makes the Debian base image if missing (kept between runs), builds the project's image from the
unchanged Dockerfile, and runs docker_image.STEPS in it (the image's unit tests, docker_image.IMAGE_TESTS; the
demo corpus; 20 iterations and a resume to 30, so that the test, run last, only checks their outputs) at a low
CPU weight: in
a cgroup of half the default weight (cpu.shares 512, cpu.weight 50) they get about a third of the cores while the
suite's workers want them all, the whole of what those leave idle, and never nothing (a nice value alone
would not do: the container runs in a cgroup, or an autogroup, of its own, which at the default weight takes
half the machine; a cgroup marked idle starved it until its own tests' wall-clock timeouts failed: a two-rank
fixture got no result in 300 s). It ends by writing WORK_DIR/result.json: the image's tag and each step's exit
status and output (the steps' data and checkpoints folders are WORK_DIR/data and WORK_DIR/checkpoints), or the
build step that failed with its command and the end of its output.

    python -m tests.docker_build WORK_DIR TAG
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests import docker_image

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"podman": "podman", "runc": "runc", "debootstrap": "debootstrap"}
BUILD_SECONDS = 2400
# A step's limit. The unit tests take about 35 CPU-seconds (the whole unit tier took 325 on the same machine,
# 2026-11-29), minutes at their low weight beside the suite; a slow machine may take several times that. The
# timeout's message shows the output's end. (Not pytest's faulthandler_timeout: its watchdog, armed in pytest's
# process, does not survive a fork, and a forked rank that then cancels a faulthandler timer of its own, as the
# hang watch does, waits for that thread for ever.)
STEP_SECONDS = 3600


class BuildFailed(Exception):
    """A step of the build failed: the message names it, its command and the end of its output."""


def podman_env(work_dir: Path) -> dict[str, str]:
    """The environment podman commands run in (docker_image.CONTAINERS_CONF, written under `work_dir`)."""
    conf = work_dir / "containers.conf"
    conf.write_text(docker_image.CONTAINERS_CONF)
    return dict(os.environ, CONTAINERS_CONF=str(conf))


def _step(name: str, command: list[str], env: dict[str, str], timeout: float = 900, **kwargs) -> None:
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired:
        raise BuildFailed(f"step '{name}' did not finish in {timeout:.0f} s: {docker_image.shell(command)}") from None
    if result.returncode != 0:
        raise BuildFailed(f"step '{name}' exited {result.returncode}: {docker_image.shell(command)}\n"
                          f"{(result.stdout + result.stderr)[-6000:]}")


def _local_cpu_torch() -> str | None:
    """A folder of this machine's pip configuration that holds the CPU torch wheel the image's Python takes."""
    from tests.test_docker import pins

    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    folders = re.findall(r"find-links='([^']+)'", config) + os.environ.get("PIP_FIND_LINKS", "").split()
    torch_pin = pins(REPO / "requirements" / "requirements.txt")["torch"]
    for folder in dict.fromkeys(folders):
        if glob.glob(f"{folder}/torch-{torch_pin}+cpu-cp311-*.whl"):
            return folder
    return None


def build(work_dir: Path, tag: str) -> None:
    """Everything the image needs, then the image `tag` (BuildFailed names the step that failed)."""
    missing = sorted({package for command, package in PACKAGES.items() if not shutil.which(command)})
    apt = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if missing:
        _step("install podman", ["apt-get", "update", "-qq"], apt)
        _step("install podman", ["apt-get", "install", "-y", "-qq", *missing], apt)
    env = podman_env(work_dir)
    if subprocess.run(["podman", "image", "exists", docker_image.BASE_IMAGE], env=env).returncode != 0:
        rootfs = work_dir / "rootfs"
        for line in docker_image.make_base(str(rootfs)):
            _step("make the Debian base image", ["bash", "-o", "pipefail", "-c", line], env)
        shutil.rmtree(rootfs)
    wheels = _local_cpu_torch()
    options = dict(pip_options=f"--find-links {wheels}", volumes=(f"{wheels}:{wheels}:ro",)) if wheels else {}
    ca_bundle = docker_image.CA_BUNDLE if Path(docker_image.CA_BUNDLE).is_file() else None
    _step("build the image", docker_image.build(tag, ca_bundle=ca_bundle, **options), env, timeout=BUILD_SECONDS,
          cwd=REPO)


def _low_weight_cgroup(name: str) -> bool:
    """Make cgroup `name` (cgroup v1's cpu hierarchy or v2's) weigh half the default for the CPU. False where
    cgroups cannot be made or set here."""
    v1, v2 = (Path("/sys/fs/cgroup/cpu"), ("cpu.shares", "512")), (Path("/sys/fs/cgroup"), ("cpu.weight", "50"))
    for root, (setting, value) in (v1, v2):
        if not (root / "cgroup.procs").is_file():
            continue
        directory = root / name
        try:
            directory.mkdir(exist_ok=True)
            (directory / setting).write_text(value)
        except OSError:
            _remove_cgroup(name)
            return False
        return True
    return False


def _remove_cgroup(name: str) -> None:
    """Remove cgroup `name` (podman makes it in every v1 hierarchy) once nothing runs in it: empty folders only,
    waiting a few seconds for podman's monitor (conmon) to leave it."""
    deadline = time.monotonic() + 10
    while tops := [top for top in [Path("/sys/fs/cgroup") / name, *Path("/sys/fs/cgroup").glob(f"*/{name}")]
                   if top.is_dir()]:
        for top in tops:
            for directory in sorted(filter(Path.is_dir, top.rglob("*")), key=lambda p: len(p.parts), reverse=True):
                _remove_folder(directory)
            _remove_folder(top)
        if time.monotonic() > deadline:
            return
        time.sleep(0.2)


def _remove_folder(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass  # something still runs there, or it is gone


def run_steps(work_dir: Path, tag: str) -> dict[str, dict[str, object]]:
    """docker_image.STEPS in the image, in order, as docs/cluster.md shows them (the data and checkpoints folders
    `work_dir`/data and `work_dir`/checkpoints mounted, owned by the image's user), each at a low CPU weight:
    {step name: {"code": its exit status, "output": the end of its output}}, up to the first that fails."""
    folders = [work_dir / "data", work_dir / "checkpoints"]
    for folder in folders:
        folder.mkdir()
        os.chown(folder, docker_image.IMAGE_UID, docker_image.IMAGE_UID)
    records = {}
    for name, argv in docker_image.STEPS.items():
        records[name] = _run_at_low_weight(work_dir, docker_image.run(tag, *map(str, folders), *argv))
        if records[name]["code"] != 0:
            break
    return records


def _run_at_low_weight(work_dir: Path, command: list[str]) -> dict[str, object]:
    """`command` (a `podman run`) in a cgroup of half the default CPU weight where podman takes one: {"code": its
    exit status, None if it did not finish in time, "output": the end of its output}."""
    name = f"tokenformer-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    command = [*command[:2], "--name", name, *command[2:]]
    cgroup = f"tokenformer-test-low-{os.getpid()}"
    low = [command[:2] + [f"--cgroup-parent=/{cgroup}"] + command[2:]] if _low_weight_cgroup(cgroup) else []
    env = podman_env(work_dir)
    try:
        for attempt in [*low, command]:  # without the cgroup if podman refuses it (exit status 125: its own error)
            result = subprocess.run(attempt, env=env, capture_output=True, text=True, timeout=STEP_SECONDS)
            if result.returncode != 125:
                break
    except subprocess.TimeoutExpired as timeout:
        # podman's client is gone, not the container: end it, or it runs on beside the rest of the suite
        subprocess.run(["podman", "rm", "--force", "--time", "0", name], env=env, capture_output=True)
        output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                         for part in (timeout.stdout, timeout.stderr))
        return {"code": None, "output": f"did not finish in {STEP_SECONDS} s: {docker_image.shell(command)}\n"
                                        f"{output[-6000:]}"}
    finally:
        _remove_cgroup(cgroup)
    return {"code": result.returncode, "output": (result.stdout + result.stderr)[-6000:]}


@dataclass
class BackgroundBuild:
    """A build running in a process group of its own, which writes its result to `work_dir`/result.json;
    `result()` waits for that file, from any process (under pytest-xdist the image test's worker may not be the
    one that started the build)."""

    work_dir: Path
    tag: str
    pid: int

    @classmethod
    def start(cls, work_dir: Path) -> BackgroundBuild:
        work_dir.mkdir(parents=True, exist_ok=True)
        tag = f"localhost/tokenformer-neox-test:{uuid.uuid4().hex[:12]}"
        with open(work_dir / "build.log", "w") as log:
            process = subprocess.Popen([sys.executable, "-m", "tests.docker_build", str(work_dir), tag], cwd=REPO,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        build = cls(work_dir, tag, process.pid)
        (work_dir / "build.json").write_text(json.dumps({"tag": tag, "pid": process.pid}))
        return build

    @classmethod
    def find(cls, work_dir: Path) -> BackgroundBuild | None:
        """The build started in `work_dir`, if one was."""
        try:
            record = json.loads((work_dir / "build.json").read_text())
        except (OSError, ValueError):
            return None
        return cls(work_dir, record["tag"], record["pid"])

    def _running(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def result(self) -> dict[str, object]:
        """Once built and its steps run: {"tag": the image's tag, "steps": run_steps()'s records, "checkpoints": the
        steps' checkpoints folder}; BuildFailed otherwise."""
        allowed = BUILD_SECONDS + len(docker_image.STEPS) * STEP_SECONDS
        deadline = time.monotonic() + allowed
        result_file = self.work_dir / "result.json"
        while not result_file.exists() and self._running():
            if time.monotonic() > deadline:
                self.stop()
                raise BuildFailed(f"the image's build and steps did not finish in {allowed} s")
            time.sleep(1)
        if not result_file.exists():
            raise BuildFailed(f"the build process ended without a result:\n"
                              f"{(self.work_dir / 'build.log').read_text()[-6000:]}")
        record = json.loads(result_file.read_text())
        if "error" in record:
            raise BuildFailed(record["error"])
        return record

    def stop(self) -> None:
        """End the build if it still runs, and remove its image if it was made (the base stays)."""
        if self._running():
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            while self._running():
                time.sleep(0.1)
        remove_image(self.tag, podman_env(self.work_dir))


def _session_folder(shared: Path) -> Path:
    return shared / "image-build"


def start_for_session(shared: Path) -> None:
    """Start the build now, for the image test to take later (tests/conftest.py, when the session will run it).
    `shared` is a folder every process of the session sees (under pytest-xdist each worker collects, and the
    first to claim the folder starts the one build)."""
    try:
        _session_folder(shared).mkdir()
    except FileExistsError:
        return
    BackgroundBuild.start(_session_folder(shared))


def take_session_build(shared: Path) -> BackgroundBuild | None:
    """The build started for this session (None if none was): its caller stops it."""
    return BackgroundBuild.find(_session_folder(shared))


def stop_session_build(shared: Path) -> None:
    """At the session's end: a build no test took (the session was interrupted) is ended, its image removed."""
    build = BackgroundBuild.find(_session_folder(shared))
    if build is not None:
        build.stop()
        shutil.rmtree(build.work_dir, ignore_errors=True)


def remove_image(tag: str, env: dict[str, str]) -> None:
    subprocess.run(["podman", "rmi", "--force", tag], env=env, capture_output=True)
    subprocess.run(["podman", "image", "prune", "--force"], env=env, capture_output=True)


def _write_result(work_dir: Path, record: dict[str, object]) -> None:
    partial = work_dir / "result.json.partial"
    partial.write_text(json.dumps(record))
    partial.rename(work_dir / "result.json")


def main(argv: list[str]) -> int:
    work_dir, tag = Path(argv[0]), argv[1]
    try:
        build(work_dir, tag)
    except BuildFailed as failure:
        _write_result(work_dir, {"error": str(failure)})
        return 1
    steps = run_steps(work_dir, tag)
    _write_result(work_dir, {"tag": tag, "steps": steps, "checkpoints": str(work_dir / "checkpoints")})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

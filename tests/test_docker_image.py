"""The Docker image, really built and run: the Dockerfile's CPU variant under podman, as its non-root user.

The base image is made here from Debian's archive (debootstrap; cached between runs as localhost/debian:bookworm),
the project's image is built from the unchanged Dockerfile with the CPU requirement set, and in the container,
offline, with data/ and a checkpoints folder mounted from the host: the unit tests of what the image provides run
(docker_image.IMAGE_TESTS), the demo corpus is built, the demo config trains 20 iterations on 2 processes and
resumes to 30. On the host, the checkpoints written inside are owned by the image's user and readable, load with
the framework and export with tools/convert_to_hf.py. Each failure names its step; the image is removed afterwards
(the base stays). The build and the steps in the image run in a process of its own (tests/docker_build.py), started
with the session when it runs this test, which runs last and checks what they left. `make docker-test` runs this
file alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import docker_build, docker_image
from tests.conftest import REPO, session_folder
from tests.test_docker import pins

pytestmark = [pytest.mark.system, pytest.mark.slow]

IMAGE_UID = docker_image.IMAGE_UID


@pytest.fixture(scope="module")
def podman(tmp_path_factory) -> dict[str, str]:
    """The environment podman commands run in (podman itself is installed by the build, if missing)."""
    if os.geteuid() != 0:
        pytest.skip("runs as root: rootful podman, debootstrap, and giving the mounted folders to the image's user")
    return docker_build.podman_env(tmp_path_factory.mktemp("podman"))


def step(name: str, command: list[str], env: dict[str, str], timeout: float = 900, **kwargs) -> str:
    """Run one step; on failure, one message naming the step, the command and the end of its output."""
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired:
        pytest.fail(f"step '{name}' did not finish in {timeout:.0f} s: {docker_image.shell(command)}")
    output = result.stdout + result.stderr
    if result.returncode != 0:
        pytest.fail(f"step '{name}' exited {result.returncode}: {docker_image.shell(command)}\n{output[-6000:]}")
    return output


@pytest.fixture(scope="module")
def built(podman, tmp_path_factory) -> dict:
    """The project's CPU image and its unit tier's record (tests/docker_build.py: started with the session, or here
    when run alone); the image is removed afterwards."""
    build = (docker_build.take_session_build(session_folder(tmp_path_factory))
             or docker_build.BackgroundBuild.start(tmp_path_factory.mktemp("image")))
    try:
        yield build.result()
    except docker_build.BuildFailed as failure:
        pytest.fail(str(failure))
    finally:
        build.stop()


def test_image_builds_runs_trains_resumes_and_its_checkpoint_serves_the_host(built, podman, tmp_path):
    image, steps = built["tag"], built["steps"]
    for name, argv in docker_image.STEPS.items():
        assert name in steps, f"step '{name}' did not run: an earlier step failed"
        code, output = steps[name]["code"], steps[name]["output"]
        assert code == 0, f"step '{name}' exited {code}: {docker_image.shell(argv)}\n{output}"
    unit_tier = steps[docker_image.UNIT_TIER_STEP]["output"]
    assert re.search(r"\d+ passed", unit_tier) and " failed" not in unit_tier, unit_tier
    assert "resumed from checkpoints/demo at iteration 20" in steps["resume"]["output"], steps["resume"]["output"]
    installed = step("pip freeze", ["podman", "run", "--rm", image, "pip", "freeze", "--all"], podman)
    frozen = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)$", installed, re.MULTILINE))
    frozen = {re.sub(r"[-_.]+", "-", name).lower(): version.split("+")[0] for name, version in frozen.items()}
    for name in ["requirements-pip.txt", *docker_image.CPU_REQUIREMENTS.split()]:
        for package, version in pins(REPO / "requirements" / name).items():
            assert frozen.get(package) == version, f"{name}: {package}=={version}, the image has {frozen.get(package)}"
    assert not [name for name in frozen if name.startswith("nvidia-")], "a CPU image without CUDA libraries"
    assert step("user", ["podman", "run", "--rm", image, "id", "-u"], podman).strip() == str(IMAGE_UID)

    checkpoints = Path(built["checkpoints"])
    run_dir = checkpoints / "demo"
    metrics = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    trained = [record["iteration"] for record in metrics if record["split"] == "train"]
    assert trained == list(range(5, docker_image.FINAL_ITERATION + 1, 5)), trained
    assert {f"global_step{i}" for i in docker_image.SAVED_ITERATIONS[1:]} <= {p.name for p in run_dir.iterdir()}
    for path in [checkpoints, *checkpoints.rglob("*")]:
        info = path.stat()
        assert (info.st_uid, info.st_gid) == (IMAGE_UID, IMAGE_UID), f"{path} is owned by {info.st_uid}:{info.st_gid}"
        assert info.st_mode & 0o444 == 0o444, f"{path} has mode {info.st_mode & 0o777:o}: not readable by all"

    from megatron.inference.loading import load_model

    model = load_model(run_dir)
    assert sum(p.numel() for p in model.parameters()) > 0
    exported = tmp_path / "exported"
    step("export with tools/convert_to_hf.py", [sys.executable, str(REPO / "tools/convert_to_hf.py"),
                                               str(run_dir), str(exported)], dict(os.environ), cwd=tmp_path)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in exported.iterdir()}

"""Shared fixtures: the repository root, the demo corpus, and deepy.py launches."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.host.startup import collector_paused

with collector_paused():
    import torch

REPO = Path(__file__).resolve().parents[1]

if not torch.cuda.is_available():
    # Triton kernels run here under Triton's interpreter, which must be on before anything imports triton
    # (torch._dynamo does): see megatron/model/pattention/tiles_triton.py.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each pytest-xdist worker (make test runs three) takes its share of the cores, as deepy.py gives each rank its
    # share, and so does whatever it starts: two workers of two OpenMP threads each on two cores would spin in each
    # other's way. A test of the default thread count removes OMP_NUM_THREADS from its launch's environment.
    _threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

pytest_plugins = ["tests.inference_fixtures"]


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """A small build of the demo corpus (BPE tokenizer + mmap dataset), once per session."""
    out = tmp_path_factory.mktemp("demo_data")
    subprocess.run(
        [sys.executable, "data_prep/demo_corpus.py", "--out", str(out), "--max-docs", "1500", "--vocab-size", "2048"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def restart_reference(demo_data, tmp_path_factory) -> Path:
    """The run of the restart tests (tests/restart_faults.py) without faults, through deepy.py; its folder."""
    from tests.restart_faults import ONE_THREAD, run_overrides

    run_dir = tmp_path_factory.mktemp("restart_reference")
    run_deepy("train.py", str(REPO / "tests" / "tiny.yml"), *run_overrides(demo_data, run_dir),
              env=dict(os.environ, **ONE_THREAD))
    return run_dir


@pytest.fixture(scope="session")
def built_gpu_kit(tmp_path_factory) -> Path:
    """`python -m benchmarks.gpu_kit build` (from the package index), once per session: the kit's test and the GPU
    check's plumbing read the same kit, whichever of make test's workers runs them (the others wait for the
    first's build; the build renames its folder into place when done)."""
    kit = session_folder(tmp_path_factory) / "gpu_kit"
    with open(kit.with_name("gpu_kit.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not kit.exists():
            subprocess.run([sys.executable, "-m", "benchmarks.gpu_kit", "build", "--out", str(kit)], cwd=REPO,
                           check=True, capture_output=True, timeout=600)
    return kit


def run_deepy(*args: str, check: bool = True, timeout: float = 600,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python deepy.py ...` from the repository root, as a user runs it, on a free master_port unless one is
    given (deepy.py refuses a busy one, and another run on the machine may hold the default); `env` replaces
    this process's environment."""
    from tests.distributed import free_port

    if not any(arg.startswith("master_port=") for arg in args):
        args = (*args, f"master_port={free_port()}")
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [sys.executable, "deepy.py", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )
    if check and result.returncode != 0:
        raise AssertionError(f"deepy.py {' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def read_metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def session_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every process of the session sees: the base temporary folder, or under pytest-xdist (make test
    runs three workers) the controller's, which holds each worker's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def pytest_collection_modifyitems(config, items) -> None:
    """Files with multi-process runs (`slow`) first, so that under pytest-xdist the long ones start early and the
    many short ones fill in around them; the Docker image's test last, so that its build (started with the
    session) has the suite's time. `gpu` tests need CUDA: skipped with that reason on a machine without it
    (`make test-gpu` runs them)."""
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: (item.path.name == IMAGE_TEST, item.path not in slow_files))  # stable
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


IMAGE_TEST = "test_docker_image.py"


def pytest_configure(config) -> None:
    # The garbage collector off while the test modules load (torch's inductor, DeepSpeed, the tests), until
    # collection ends: what megatron/host/startup.py does for the entry points, across two of pytest's steps here.
    gc.disable()


def pytest_collection_finish(session) -> None:
    """When the session runs the Docker image's test (as root, which it needs), the image starts building now, in
    a process of its own: it mostly waits on the network and the disk (tests/docker_build.py). The collector is
    told to leave the imports alone."""
    if os.geteuid() == 0 and not session.config.option.collectonly and any(
            item.path.name == IMAGE_TEST for item in session.items):
        from tests import docker_build

        docker_build.start_for_session(session_folder(session.config._tmp_path_factory))
    # What collection imported (torch, DeepSpeed, inductor, the tests: 560,000 objects) is moved out of the
    # garbage collector's sight: its full collections, here and in every rank forked from here, then walk only what
    # the tests make (they were a third of this process's CPU time in a profile of a tensor-parallel test).
    gc.freeze()
    gc.enable()


def pytest_sessionstart(session) -> None:
    if getattr(session.config.option, "dist", "no") != "no" and not os.environ.get("PYTEST_XDIST_WORKER"):
        gc.enable()  # pytest-xdist's controller collects nothing (its workers do): the collector back on now


def pytest_unconfigure(config) -> None:
    gc.unfreeze()  # the frozen objects freed at exit as usual (nanobind reports them as leaks otherwise)


def pytest_sessionfinish(session, exitstatus) -> None:
    """The build no test took is ended: by the one process of the session, or under pytest-xdist by the controller,
    once every worker is done."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from tests import docker_build

    docker_build.stop_session_build(session.config._tmp_path_factory.getbasetemp())

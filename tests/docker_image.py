"""The podman commands that make, build and run the CPU Docker image: tests/test_docker_image.py runs them,
docs/cluster.md shows them (tests/test_docker.py checks that it shows these)."""

from __future__ import annotations

import re

BASE_IMAGE = "localhost/debian:bookworm"
ROOTFS_MIRROR = "http://deb.debian.org/debian"
# The GPU image's files (the Dockerfile's REQUIREMENTS: the core, MPI, logging) and the test tools its unit tests
# run with; not lm-eval's (eval.py), which the GPU image leaves out too and which made a sixth of the build, nor
# Triton's (a gigabyte, for the flash kernels' interpreter tests, which the image does not run).
CPU_REQUIREMENTS = "requirements.txt requirements-dev.txt requirements-logging.txt requirements-mpi.txt"
# torch==2.13.0 from PyPI is the CUDA build; the CPU build comes from PyTorch's index (or a local wheel folder).
CPU_TORCH_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
UNIT_TIER = "not slow and not network and not system and not gpu"
# The unit tests of what the image itself provides, not the whole tier the host's suite already runs (about a
# tenth of its CPU time): torch and the model, tokenizers and sentencepiece, numpy and the C++ data helpers
# compiled into the image's cache, the config's YAML, DeepSpeed's op cache and engine for the image's user,
# process launching and signals in a container, and transformers for the conversions.
IMAGE_TESTS = ("tests/test_model.py", "tests/test_tokenizer.py", "tests/test_indexed_dataset.py",
               "tests/test_index_helpers.py", "tests/test_config.py", "tests/test_extension_cache.py",
               "tests/test_growth_keeps_state.py", "tests/test_generation.py", "tests/test_local_ranks.py",
               "tests/test_supervise.py", "tests/test_hf_export.py")
# podman on hosts whose cgroups crun refuses and whose hard open-files limit cannot be raised (as CI's).
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


def make_base(rootfs: str) -> list[str]:
    """Shell lines making a minimal Debian 12 image from Debian's archive, for hosts that reach no registry."""
    return [
        f"debootstrap --variant=minbase bookworm {rootfs} {ROOTFS_MIRROR}",
        f"tar -C {rootfs} -c . | podman import --change 'CMD [\"/bin/bash\"]' - {BASE_IMAGE}",
    ]


def build(image: str, pip_options: str = CPU_TORCH_INDEX, ca_bundle: str | None = CA_BUNDLE,
          volumes: tuple[str, ...] = ()) -> list[str]:
    """`podman build` of the CPU image. `--format docker` keeps the Dockerfile's SHELL (bash, pipefail)."""
    command = ["podman", "build", "--format", "docker", "-t", image, "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
               "--build-arg", f"REQUIREMENTS={CPU_REQUIREMENTS}", "--build-arg", f"PIP_OPTIONS={pip_options}"]
    for volume in volumes:
        command += ["--volume", volume]
    if ca_bundle:
        command += ["--secret", f"id=ca_bundle,src={ca_bundle}"]
    return [*command, "."]


def run(image: str, data: str, checkpoints: str, *argv: str) -> list[str]:
    """A command in the image as its user (uid 1000), offline, with the host's data and checkpoints mounted."""
    return ["podman", "run", "--rm", "--network=none", "--shm-size=1g", "-v", f"{data}:/workspace/data",
            "-v", f"{checkpoints}:/workspace/checkpoints", image, *argv]


TRAIN = ("python", "deepy.py", "train.py", "configs/demo.yml", "save=checkpoints/demo", "load=checkpoints/demo",
         "log_dir=checkpoints/demo/logs", "checkpoint_factor=10", "eval_interval=10", "eval_iters=2", "log_interval=5")
IMAGE_UID = 1000  # the Dockerfile's user
UNIT_TIER_STEP = "unit tests"
STEPS = {
    UNIT_TIER_STEP: ("python", "-m", "pytest", *IMAGE_TESTS, "-m", UNIT_TIER, "-p", "no:cacheprovider"),
    "prepare data": ("python", "data_prep/demo_corpus.py", "--out", "data/demo"),
    "train": (*TRAIN, "train_iters=20"),
    "resume": (*TRAIN, "train_iters=30"),
}
FINAL_ITERATION = 30
SAVED_ITERATIONS = (10, 20, 30)


def shell(command: list[str] | tuple[str, ...]) -> str:
    """The command as one would type it: words with spaces, quotes or `$` in double quotes."""
    return " ".join(arg if re.fullmatch(r"[\w@%+=:,./-]+", arg) else '"' + arg.replace('"', '\\"') + '"'
                    for arg in command)


def documented_commands() -> list[str]:
    """What docs/cluster.md shows, for the image tag and host folders a user would use."""
    image, data, checkpoints = "tokenformer-neox:cpu", "$PWD/data", "$PWD/checkpoints"
    commands = [shell(["mkdir", "-p", "data", "checkpoints"]), shell(["chown", "1000:1000", "data", "checkpoints"])]
    commands += make_base("rootfs")
    commands.append(shell(build(image)))
    commands += [shell(run(image, data, checkpoints, *argv)) for argv in STEPS.values()]
    return commands

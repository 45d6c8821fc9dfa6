# TokenFormer-NeoX on NVIDIA GPUs, for reproducible runs.
#
#   docker build -t tokenformer-neox .
#   docker run --gpus all --rm --ipc=host -v "$PWD/data:/workspace/data" -v "$PWD/checkpoints:/workspace/checkpoints" \
#       tokenformer-neox python deepy.py train.py configs/150M.yml configs/local_setup.yml
#
# The container runs as uid 1000: the mounted checkpoints folder must be writable by it.
# CUDA 13.0 is what torch==2.13.0 from PyPI is built for; Python 3.11 is the version the CPU
# set-up is tested with; the Python packages are exactly the pins of requirements/
# (tests/test_docker.py checks all three). docs/cluster.md has the multi-node commands.
#
# Build arguments (defaults: the GPU image above):
#   BASE_IMAGE    any Debian or Ubuntu image with Python 3.11 in its archive (a CPU image: debian:bookworm)
#   REQUIREMENTS  files of requirements/ to install (a CPU image: requirements.txt requirements-dev.txt ...)
#   PIP_OPTIONS   extra pip options, e.g. "--extra-index-url https://download.pytorch.org/whl/cpu" for CPU torch
# Behind a TLS-intercepting proxy, give pip its CA bundle as a build secret (never stored in the image):
#   docker build --secret id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt ...
# tests/test_docker_image.py builds and runs the CPU image this way with podman (docs/cluster.md).
ARG BASE_IMAGE=nvidia/cuda:13.0.2-cudnn-devel-ubuntu22.04
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Python 3.11 from Ubuntu's universe, g++ for the C++ data helpers, ssh/pdsh and Open MPI for the
# multi-node launchers. Ubuntu moves these versions within a release, so they are not pinned
# (DL3008); everything Python is.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3.11 python3.11-venv python3.11-dev g++ openssh-client pdsh openmpi-bin \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python3.11 -m venv /opt/venv
COPY requirements/ /tmp/requirements/
ARG REQUIREMENTS="requirements-gpu.txt requirements-mpi.txt requirements-logging.txt"
ARG PIP_OPTIONS=""
# The pins are in the files REQUIREMENTS names (DL3013), pip's own in requirements-pip.txt, installed
# first (the venv's pip 23 is the slower installer); splitting the two arguments into words is
# the point (SC2046, SC2086).
# hadolint ignore=DL3013,SC2046,SC2086
RUN --mount=type=secret,id=ca_bundle \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && pip install $PIP_OPTIONS -r /tmp/requirements/requirements-pip.txt \
    && pip install $PIP_OPTIONS $(printf -- '-r /tmp/requirements/%s ' $REQUIREMENTS) \
    && rm -rf /tmp/requirements

RUN useradd --create-home --uid 1000 --user-group tokenformer \
    && install -d -o 1000 -g 1000 /workspace
WORKDIR /workspace
COPY --chown=1000:1000 . .
# The project itself, editable: tools/ and benchmarks/ import `megatron` from the code in /workspace. Its
# bytecode compiled now, as pip compiled the packages': otherwise each new container's first processes (its
# ranks, which start together) each compile the modules they import.
RUN pip install --no-deps --no-build-isolation -e . \
    && python -m compileall -q megatron benchmarks tools data_prep ./*.py \
    && chown -R 1000:1000 /workspace

# The C++ data helpers, compiled now into a cache the non-root user owns (rebuilt there if the source
# changes). DL3064 mistakes the variable's name for a secret: it holds a directory.
# hadolint ignore=DL3064
ENV TOKENFORMER_CACHE_DIR=/opt/tokenformer-cache
RUN python -m megatron.data.compiled_helpers \
    && chown -R 1000:1000 /opt/tokenformer-cache
USER 1000:1000

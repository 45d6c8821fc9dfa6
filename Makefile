# Two commands set everything up on a fresh machine: `make demo` and `make test`.

# Python writes each module's bytecode when a process first imports it (its default), whatever the shell says: with
# PYTHONDONTWRITEBYTECODE set (as on this project's CI machines) every process would compile torch and the project
# from source again (`make test` took 31 min instead of 20). Only what is imported is compiled, once: 3,400 of
# site-packages' 18,900 modules for torch, DeepSpeed, dynamo and transformers (8 CPU-s, against 53 for compileall
# over all of them). __pycache__ is git-ignored.
unexport PYTHONDONTWRITEBYTECODE
PYTHON_BOOT ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
REQUIREMENTS := requirements/requirements.txt requirements/requirements-dev.txt requirements/requirements-logging.txt \
    requirements/requirements-eval.txt requirements/requirements-triton.txt
DEMO_DATA := data/demo/demo_text_document.bin
# DeepSpeed compiles a small op on first start; keep it with this venv so other installs never clash.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions

.PHONY: install demo demo-data test test-fast test-gpu docker-test docs bench bench-gpu gpu-kit scaling-study \
    clean-demo

install: $(STAMP)

# torch is pinned to the CPU build (requirements.txt); see README for GPU installs. pip itself is pinned and installed
# first (requirements-pip.txt): the venv's own pip took 46 CPU-s for the rest, against 26-36 for that one.
$(STAMP): $(REQUIREMENTS) requirements/requirements-pip.txt pyproject.toml
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements/requirements-pip.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile $(foreach r,$(REQUIREMENTS),-r $(r))
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(DEMO_DATA): data_prep/demo_corpus.py | $(STAMP)
	$(PY) data_prep/demo_corpus.py --out data/demo

demo-data: $(DEMO_DATA)

demo: $(DEMO_DATA)
	$(PY) deepy.py train.py configs/demo.yml

# Everything but the `gpu` tier (markers: pyproject.toml), on three workers, each test file on one of them (its
# module fixtures built once); tests/conftest.py starts the files with multi-process runs first. Three on two
# cores: the launches wait on signals, timeouts and SLURM's polling, and two workers left 5-8 % of the cores idle.
test: $(STAMP)
	$(PY) -m pytest tests -m "not gpu" -n 3 --dist loadfile --durations=30

# Unit tests only: no multi-process runs, package index, system services or GPU (about 2 minutes).
test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow and not network and not system and not gpu"

# Needs a CUDA device; elsewhere every test is skipped with that reason.
test-gpu: $(STAMP)
	$(PY) -m pytest tests -m gpu

# The Docker image built with podman (CPU variant, local Debian base) and run: tests/test_docker_image.py.
# Installs podman, runc and debootstrap with apt-get when missing (as root); part of `make test` too.
docker-test: $(STAMP)
	$(PY) -m pytest tests/test_docker_image.py

docs: $(STAMP)
	$(PY) -m megatron.config.docs

# The benchmark suite (figures and how to read them: benchmarks/RESULTS.md, docs/performance.md).
# benchmarks/grow.py synthesises a 22 GB checkpoint under BENCH_DIR and deletes it afterwards.
BENCH_DIR ?= /tmp/tokenformer-bench
bench: $(STAMP) requirements/requirements-bench.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements/requirements-bench.txt
	$(PY) -m benchmarks.pattention
	$(PY) -m benchmarks.memory_model
	$(PY) -m benchmarks.train_throughput
	$(PY) -m benchmarks.framework_step
	$(PY) -m benchmarks.data_preprocess_throughput
	$(PY) -m benchmarks.sample_fetch
	$(PY) -m benchmarks.tp_comm
	rm -rf $(BENCH_DIR)/grow && $(PY) -m benchmarks.grow --workdir $(BENCH_DIR)/grow

# Flash Pattention's Triton kernels and training-step MFU on one CUDA GPU (without one it says so and exits 2).
bench-gpu: $(STAMP)
	$(PY) -m benchmarks.gpu_pattention

# Wheels of the packages the borrowed GPU machine's image lacks (DeepSpeed & co.), for its offline install.
gpu-kit: $(STAMP)
	$(PY) -m benchmarks.gpu_kit build --out .gpu-kit

# Issues 19, 28: growth S1 -> S2 -> S3 (both growth modes) vs S3 from scratch, the same stages without growth,
# S1 trained longer and a dense Transformer, three seeds, through tools/progressive_scaling.py, on the synthetic
# corpus data_prep/markov_corpus.py builds first (about 40 min on 2 cores); benchmarks/incremental_scaling/README.md.
# Both tasks (markov, knowledge) with the ablation. A check in a few minutes: make scaling-study STUDY_ARGS=--quick.
# Another corpus: make scaling-study STUDY_ARGS="--data-path P --vocab-file F".
scaling-study: $(STAMP) requirements/requirements-bench.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements/requirements-bench.txt
	$(PY) -m benchmarks.incremental_scaling.run_study $(STUDY_ARGS)

clean-demo:
	rm -rf demo_run

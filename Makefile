# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON_BOOT ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
REQUIREMENTS := requirements/requirements.txt requirements/requirements-dev.txt requirements/requirements-logging.txt \
    requirements/requirements-eval.txt
DEMO_DATA := data/demo/demo_text_document.bin
# DeepSpeed compiles a small op on first start; keep it with this venv so other installs never clash.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions

.PHONY: install demo demo-data test docs clean-demo

install: $(STAMP)

# torch is pinned to the CPU build (requirements.txt); see README for GPU installs.
$(STAMP): $(REQUIREMENTS) pyproject.toml
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(foreach r,$(REQUIREMENTS),-r $(r))
	touch $(STAMP)

$(DEMO_DATA): $(STAMP) data_prep/demo_corpus.py
	$(PY) data_prep/demo_corpus.py --out data/demo

demo-data: $(DEMO_DATA)

demo: $(DEMO_DATA)
	$(PY) deepy.py train.py configs/demo.yml

test: $(STAMP)
	$(PY) -m pytest tests

docs: $(STAMP)
	$(PY) -m megatron.config.docs

clean-demo:
	rm -rf demo_run

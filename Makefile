# make demo | make test | make notebooks | make venv | make clean
#
# Everything runs in a virtual environment built from setup.cfg: `make demo` installs nsa and what the
# demo needs (the `demo` extra: matplotlib); `make test` adds the `test` extra, everything the suite imports
# (pytest, chex, Triton for its CPU interpreter, the `demo`, `notebooks` and `nnx` extras, build and twine).
# Override on the command line:
#   PYTHON    the interpreter the venv is made from   (default python3, >= 3.11)
#   VENV      the venv's folder                       (default .venv)
#   JAX_SPEC  a pip requirement pinning JAX           (default: the newest pip finds), e.g. 'jax==0.11.2'
#   MARKERS   the tests to run, as pytest -m          (default: not gpu)
#   PYTEST_ARGS  more pytest arguments: files, -k    (default: none), e.g. PYTEST_ARGS=tests/test_api.py
#   WORKERS   pytest-xdist processes                  (default: auto, one per core, at most 4; 0: none)
#   TEST_XLA_FLAGS  XLA_FLAGS the suite runs with     (default: LLVM's optimisations off; empty: XLA's own)
# e.g. make test PYTHON=python3.12 VENV=.venv-py3.12 JAX_SPEC='jax==0.11.2'

PYTHON ?= python3
VENV ?= .venv
JAX_SPEC ?=
PYTEST_ARGS ?=
# the tests `make test` runs (pytest -m), and its worker processes (pytest-xdist; each core its own)
MARKERS ?= not gpu
WORKERS ?= auto
# The suite's programs are small and many: compiling them is most of its time. Without LLVM's optimisations
# XLA compiles them faster (the CPU suite on 2 cores: 1606 against 2075 s, the same 756 tests passing); the GPU
# runs (scripts/) do not go through make and keep XLA's defaults.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0

PY := $(VENV)/bin/python
# The venv with nsa alone, and the settings it was built with: rebuilt (and its extras with it) when
# setup.cfg, pyproject.toml or a setting changes. Each extra is then installed once: $(VENV)/.nsa-extra-NAME.
BASE := $(VENV)/.nsa-installed
SETTINGS := python=$(PYTHON) jax=$(JAX_SPEC)

.PHONY: venv demo test notebooks clean FORCE

venv: $(VENV)/.nsa-extra-test

ifneq "$(SETTINGS)" "$(shell cat $(BASE) 2>/dev/null)"
$(BASE): FORCE
endif

$(BASE): setup.cfg pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "nsa needs Python >= 3.11, $(PYTHON) is " + sys.version'
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e . $(if $(JAX_SPEC),'$(JAX_SPEC)')
	echo '$(SETTINGS)' > $@

$(VENV)/.nsa-extra-%: $(BASE)
	$(PY) -m pip install -e '.[$*]' $(if $(JAX_SPEC),'$(JAX_SPEC)')
	touch $@

demo: $(VENV)/.nsa-extra-demo
	$(PY) -m nsa.demo

test: venv
	XLA_FLAGS="$(TEST_XLA_FLAGS) $$XLA_FLAGS" $(PY) -m pytest -q -m "$(MARKERS)" -n $(WORKERS) --maxprocesses=4 --dist worksteal $(PYTEST_ARGS)

# re-executes every notebook in place, outputs and all (what is committed)
notebooks: $(VENV)/.nsa-extra-notebooks
	$(PY) scripts/notebooks.py notebooks/*.ipynb

clean:
	rm -rf $(sort $(VENV) .venv) .venv-* build dist *.egg-info .pytest_cache demo_selection.png
	find . -name __pycache__ -type d -not -path './.venv*' -exec rm -rf {} +

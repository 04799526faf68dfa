# make demo | make test | make venv | make clean
#
# Everything runs in a virtual environment built from setup.cfg. Override on the command line:
#   PYTHON    the interpreter the venv is made from   (default python3, >= 3.11)
#   VENV      the venv's folder                       (default .venv)
#   JAX_SPEC  a pip requirement pinning JAX           (default: the newest pip finds), e.g. 'jax==0.11.2'
#   EXTRAS    the extras of setup.cfg to install      (default test,demo)
# e.g. make test PYTHON=python3.12 VENV=.venv-py3.12 JAX_SPEC='jax==0.11.2'

PYTHON ?= python3
VENV ?= .venv
JAX_SPEC ?=
EXTRAS ?= test,demo
PYTEST_ARGS ?=

PY := $(VENV)/bin/python
# Holds the settings the venv was built with; rebuilt when setup.cfg, pyproject.toml or a setting changes.
STAMP := $(VENV)/.nsa-installed
SETTINGS := python=$(PYTHON) jax=$(JAX_SPEC) extras=$(EXTRAS)

.PHONY: venv demo test clean FORCE

venv: $(STAMP)

ifneq "$(SETTINGS)" "$(shell cat $(STAMP) 2>/dev/null)"
$(STAMP): FORCE
endif

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "nsa needs Python >= 3.11, $(PYTHON) is " + sys.version'
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[$(EXTRAS)]' $(if $(JAX_SPEC),'$(JAX_SPEC)')
	echo '$(SETTINGS)' > $@

demo: venv
	$(PY) -m nsa.demo

test: venv
	$(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

clean:
	rm -rf $(sort $(VENV) .venv) .venv-* build dist *.egg-info .pytest_cache demo_selection.png
	find . -name __pycache__ -type d -not -path './.venv*' -exec rm -rf {} +

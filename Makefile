# Two entry points for a fresh machine; each creates .venv and installs the project on first use.
#   make demo   — the main job on CPU
#   make test   — the whole test suite (slow tests included)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast install

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,eval,serve]'
	touch $@

demo: install
	$(PY) scripts/demo.py

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

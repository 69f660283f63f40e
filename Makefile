# Two entry points for a fresh machine; each creates .venv and installs the project on first use.
#   make demo   — the main job on CPU
#   make test   — the whole test suite (slow tests included)
# and, for contributors, `make lint` (what .ci/run and .pre-commit-config.yaml run) and `make docs`
# (the documentation site, built strictly into site/; `make lint` builds it too).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The exact versions the test suite passes with; pyproject.toml declares the compatible ranges.
CONSTRAINTS := constraints.txt

.PHONY: demo test test-fast lint docs install

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --retries 10 -c $(CONSTRAINTS) --upgrade pip
	@# A dropped connection mid-download (TensorFlow's wheel is 570 MB) is retried twice more after a
	@# pause, resuming where it stopped, rather than failing the whole install.
	for attempt in 1 2 3; do \
	    $(PY) -m pip install --quiet --retries 10 --resume-retries 10 -c $(CONSTRAINTS) \
	        -e '.[test,eval,serve,docs,pod]' && break; \
	    [ $$attempt -lt 3 ] || exit 1; \
	    echo "pip install failed (attempt $$attempt of 3); trying again in 30 s" >&2; sleep 30; \
	done
	touch $@

demo: install
	$(VENV)/bin/gptj-demo

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

lint: install docs
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# A broken link, anchor or page fails the build (mkdocs.yml: strict).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

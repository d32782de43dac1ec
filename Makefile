# Two commands for a newcomer: `make serve` (install + start on the default model) and `make test` (style, types, tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test test-fast lint

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0  # the CPU build; an unpinned torch pulls a multi-GB CUDA build
	$(PY) -m pip install -q -e ".[test]"
	touch $@

serve: install
	$(VENV)/bin/tokenmill serve --host $(HOST) --port $(PORT)

test: lint
	$(PY) -m pytest -q

test-fast: lint
	$(PY) -m pytest -q -m "not e2e"

# The style CI enforces: lint, formatting and types (mypy's settings are in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check tokenmill tests scripts
	$(VENV)/bin/ruff format --check tokenmill tests scripts
	$(VENV)/bin/mypy

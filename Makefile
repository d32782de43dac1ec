# Two commands for a newcomer: `make serve` (install + start on the default model) and `make test` (style, types, tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test test-fast test-ray lint

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0  # the CPU build; an unpinned torch pulls a multi-GB CUDA build
	$(PY) -m pip install -q -e ".[test,ray]"
	touch $@

serve: install
	$(VENV)/bin/tokenmill serve --host $(HOST) --port $(PORT)

# Ray probes outward addresses to find its own: the `ray` tier runs in a private network namespace, loopback alone
# (as root a plain one; otherwise inside a user namespace too).
IN_PRIVATE_NETWORK := unshare -n $(if $(filter 0,$(shell id -u)),,-r) sh -c 'ip link set lo up && exec "$$0" "$$@"'

test: lint
	$(PY) -m pytest -q -m "not ray"
	$(IN_PRIVATE_NETWORK) $(PY) -m pytest -q -m ray

test-fast: lint
	$(PY) -m pytest -q -m "not e2e and not ray"

test-ray: install
	$(IN_PRIVATE_NETWORK) $(PY) -m pytest -q -m ray

# The style CI enforces: lint, formatting and types (mypy's settings are in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check tokenmill tests scripts
	$(VENV)/bin/ruff format --check tokenmill tests scripts
	$(VENV)/bin/mypy

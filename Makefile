# Volga: `make demo` runs the embedded default, `make test` runs the whole suite.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
CRIU_PREFIX ?= $(HOME)/.cache/volga/criu

.PHONY: setup demo test test-fast test-gpu lint typecheck criu bench-tiers clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,dev]'
	touch $@

$(CRIU_PREFIX)/bin/criu:
	scripts/install-criu.sh $(CRIU_PREFIX)

criu: $(CRIU_PREFIX)/bin/criu

setup: $(VENV)/.installed criu

demo: setup
	$(VENV)/bin/volga demo

test: setup lint
	$(PY) -m pytest -m 'not gpu' $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m 'not gpu and not integration' $(PYTEST_ARGS)

# On the GPU machine: the gpu-marked tests (torch, the driver checkpoint API, CRIU).
test-gpu:
	python3 -m pytest -m gpu -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy volga_operator volga_agent

bench-tiers: setup
	$(VENV)/bin/volga bench tiers --json --out bench/results/tiers-cpu.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

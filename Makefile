# The two commands: `make demo` (the main job) and `make test` (the whole suite).
# Both install what they need into .venv; a second run reuses it.
#
# TORCH_SPEC picks the torch build. The default is the CPU build this project's CI uses;
# elsewhere e.g. `make test TORCH_SPEC="torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124"`.
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip
STAMP      := $(VENV)/.ampguard-installed

.PHONY: install horovod prometheus demo dashboards test test-fast lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

horovod: install
	PY=$(PY) bash scripts/build_horovod.sh

prometheus:
	bash scripts/install_prometheus.sh

demo: install
	$(VENV)/bin/ampguard demo

# Regenerate the committed dashboards/ (Grafana JSON, Prometheus rules, promtool tests) from the
# metric catalogue; tests/unit/test_dashboards.py checks they equal the generator's output.
dashboards: install
	$(PY) -m ampguard.dashboards dashboards

# Two pytest workers (CI's two cores): the suite in ~6 minutes instead of ~9 on one.
test: install horovod prometheus
	$(PY) -m ruff check ampguard tests examples benchmarks
	$(PY) -m mypy
	$(PY) -m pytest -n 2

test-fast: install
	$(PY) -m pytest -m "not horovod and not integration"

lint: install
	$(PY) -m ruff check ampguard tests examples benchmarks
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

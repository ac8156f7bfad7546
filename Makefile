# Every target builds .venv from nothing when it is missing or stale.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SCENARIO ?= guided
BENCH_ARGS ?=

.PHONY: run test check bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch and torchvision are pinned in pyproject.toml; install them first so nothing pulls another build.
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e '.[dev,ray]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m pipeline serve --demo

test: $(STAMP)
	$(PY) -m pytest -q

check: $(STAMP)
	$(VENV)/bin/ruff check pipeline stages vision sampling tests examples
	$(VENV)/bin/ruff format --check pipeline stages vision sampling tests examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: $(STAMP)
	$(PY) -m pipeline bench $(SCENARIO) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

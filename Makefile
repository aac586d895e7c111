# make demo : set up the virtual environment and stream one real Synthea patient through the embedded stack
# make test : set up and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test lint bench clean

$(BIN)/stam: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(BIN)/stam

setup: $(BIN)/stam

demo: setup
	STAM_HOME=.stam/demo $(BIN)/stam demo

test: setup
	$(BIN)/python -m pytest -q -ra

lint: setup
	$(BIN)/ruff check schemas stam topology workers tests benchmarks
	$(BIN)/mypy

bench: setup
	$(BIN)/python -m benchmarks.write_path
	$(BIN)/python -m benchmarks.faust_floor

clean:
	rm -rf .stam

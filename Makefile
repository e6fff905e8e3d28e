# gpuq: `make demo` and `make test` create .venv, install the project, and run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: install demo test lint schemas clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	@touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/gpuq demo

lint: install
	$(BIN)/ruff check .

test: install lint
	$(BIN)/pytest

schemas: install
	$(BIN)/python -m shared.schemas --write

clean:
	rm -rf $(VENV) .gpuq .pytest_cache .ruff_cache .hypothesis

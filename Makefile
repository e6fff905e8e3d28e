# gpuq: `make demo` and `make test` create .venv, install the project, and run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: install demo test lint typecheck imports tools schemas clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	@touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/gpuq demo

# The gates `make test` runs before the suite (.pre-commit-config.yaml runs the same ones).
lint: install
	$(BIN)/ruff check .

typecheck: install
	$(BIN)/mypy

imports: install
	$(BIN)/lint-imports

tools:
	@sh scripts/ensure-prometheus.sh

test: install lint typecheck imports tools
	$(BIN)/pytest

schemas: install
	$(BIN)/python -m shared.schemas --write

clean:
	rm -rf $(VENV) .gpuq .pytest_cache .ruff_cache .hypothesis .mypy_cache .import_linter_cache

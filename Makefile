# gpuq: `make demo` and `make test` create .venv, install the project, and run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

# Validators that cannot live in the project's venv (their pins clash with it) get venvs of their own here.
TOOLS  := .tools
FOCUS_VALIDATOR := $(TOOLS)/focus-validator/bin/focus-validator

.PHONY: install demo test test-kube lint typecheck imports tools chart-tools chart-test schemas lock clean

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

# promtool (alert-rule tests), and the FinOps Foundation's FOCUS validator, which checks `gpuq report --export focus`
# (tests/service/metering). Its last release for Python 3.11 (1.0.0) needs multimethod<1.11 (pandera's import of
# `overload`), and pins pandas/pydantic versions of its own: hence an isolated venv.
tools: $(FOCUS_VALIDATOR)
	@sh scripts/ensure-prometheus.sh
	@sh scripts/ensure-chromium.sh

$(FOCUS_VALIDATOR):
	$(PYTHON) -m venv $(TOOLS)/focus-validator
	$(TOOLS)/focus-validator/bin/pip install -q --upgrade pip
	$(TOOLS)/focus-validator/bin/pip install -q "focus-validator==1.0.0" "multimethod<1.11"

test: install lint typecheck imports tools chart-tools
	$(BIN)/pytest

# The chart's offline checks (helm lint/template, kubernetes-validate, CRD schemas, hadolint) run inside pytest
# (tests/deploy/); their tools are fetched once into .tools/ by deploy/tools/fetch-chart-tools.sh (provenance there).
chart-tools: install
	deploy/tools/fetch-chart-tools.sh

chart-test: chart-tools
	$(BIN)/pytest -q tests/deploy

# The Kubernetes tests (those using the kube_api fixture) against a real cluster, e.g. kind on a laptop.
# Plain `make test` runs the same tests against the fake API server in tests/kube/kubefake.
test-kube: install
	@if [ -z "$$GPUQ_KUBECONFIG" ]; then \
	  echo "make test-kube runs the Kubernetes tests against a real cluster: set GPUQ_KUBECONFIG to its kubeconfig"; \
	  echo "  e.g. kind create cluster && kind get kubeconfig > /tmp/kind.yaml && GPUQ_KUBECONFIG=/tmp/kind.yaml make test-kube"; \
	  echo "(plain 'make test' runs these tests against the fake API server)"; \
	  exit 2; \
	fi
	$(BIN)/pytest -m kube

schemas: install
	$(BIN)/python -m shared.schemas --write

# requirements.lock: the image's dependencies (pyproject's [project].dependencies, no extra), every one pinned with
# the hashes of its files on PyPI, for CPython 3.11 on Linux (x86_64 and aarch64 wheels alike). The Dockerfile
# installs it with --require-hashes, then the gpuq wheel with --no-deps. Run after changing the dependencies and
# commit the result; pins already in the file are kept unless LOCK_FLAGS=--upgrade (or --upgrade-package NAME).
# uv runs from a venv of its own in .tools/, never the project's.
UV := $(TOOLS)/uv/bin/uv
UV_VERSION := 0.13.9

lock: $(UV)
	$(UV) pip compile pyproject.toml --quiet --generate-hashes --python-version 3.11 --python-platform linux \
	  --no-config --index-url https://pypi.org/simple --custom-compile-command "make lock" $(LOCK_FLAGS) \
	  --output-file requirements.lock

$(UV):
	$(PYTHON) -m venv $(TOOLS)/uv
	$(TOOLS)/uv/bin/pip install -q "uv==$(UV_VERSION)"

clean:
	rm -rf $(VENV) $(TOOLS) .gpuq .pytest_cache .ruff_cache .hypothesis .mypy_cache .import_linter_cache

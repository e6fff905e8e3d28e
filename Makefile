# gpuq: `make demo` and `make test` create .venv, install the project, and run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: install demo test test-kube lint typecheck imports tools chart-tools chart-test schemas clean

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

clean:
	rm -rf $(VENV) .gpuq .pytest_cache .ruff_cache .hypothesis .mypy_cache .import_linter_cache .tools

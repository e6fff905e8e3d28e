"""gpuq's tools: the benchmarks (`gpuq bench ...`, gpuq_tools/bench) and the chaos harness (`gpuq chaos`,
gpuq_tools/chaos).

They drive the product (services, shared) from outside and are no part of it: nothing in services, shared or cli
imports this package (an import-linter contract); the CLI names its commands here only as `module:attribute`
strings, loaded when such a command runs (cli/main.py). The service image leaves the package out (Dockerfile)."""

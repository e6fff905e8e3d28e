"""The benchmarks behind `gpuq bench ...`: one module per command (cli/main.py's Benchmarks table), each printing
its figures; docs/benchmarks.md gives the current ones and how each was measured."""

"""Fault injection against a running platform: `gpuq chaos` and the bounded chaos test (harness.py)."""

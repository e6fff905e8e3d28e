"""The executors' pure core: reading dcgm-exporter series (from Prometheus query results), attributing them to
jobs, and deciding GPU health. No I/O and no clock: the shell (services/executor/dcgm.py) queries Prometheus and
passes the results and the time in."""

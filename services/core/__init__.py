"""The pure decision cores, one tree that every shell imports downward.

Each service's shell (`services/<service>/`) imports its core from here; no core imports a shell, the runtime
plumbing or an I/O library (the import contracts in pyproject.toml). Among themselves the cores import downward:
scheduler and executor at the bottom, then preemption, admission, pipeline (admission → placement → preemption on
one snapshot), the ETA on top of the pipeline; metering, telemetry and kube beside them.
"""

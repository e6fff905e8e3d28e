"""Pure parts of the Kubernetes executor: node and workload mapping, placement patches, pod status, backoff.

Everything here works on Kubernetes objects as JSON dicts, takes `now` as an argument and does no I/O, so it is
unit-tested without a server and passes the purity test."""

"""`executor/kube`: the Kubernetes executor. Pure translation lives in `core/`; API calls in the other modules."""

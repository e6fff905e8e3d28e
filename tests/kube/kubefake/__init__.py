"""kubefake: a stateful fake Kubernetes API server on kmock, with the test-side kube-scheduler, kubelet and workload
controllers (Job, JobSet, PyTorchJob, RayJob), for tests that reach Kubernetes through a real client.

Tests use the `kube_api` fixture (tests.kube.kubefake.fixtures, loaded for the whole suite); see its docstring for
how to get a kubeconfig, base URL, token or client, and docs/kubernetes.md for what the fake emulates and what it
does not."""

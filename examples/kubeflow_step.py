"""A Kubeflow Pipelines (kfp v2) step that trains on gpuq: the component submits the job with the producer SDK and
waits for it; the pipeline step fails when the job does. Compile with `python examples/kubeflow_step.py` (writes
pipeline.yaml) and upload it to Kubeflow.

The component's pod needs GPUQ_API_URL and a team's GPUQ_TOKEN (e.g. from a Kubernetes secret, with
kfp-kubernetes' use_secret_as_env).
"""

from kfp import compiler, dsl


@dsl.component(base_image="python:3.11-slim", packages_to_install=["gpuq"])
def gpuq_train(gpus: int, max_runtime_s: int, project: str) -> str:
    from gpuq_sdk import Client

    with Client() as gpuq:
        job = gpuq.submit(gpus=gpus, max_runtime_s=max_runtime_s, labels={"project": project, "via": "kubeflow"})
        final = gpuq.wait(job.job_id, timeout_s=max_runtime_s + 3600, poll_s=30)
        if final["state"] != "completed":
            raise RuntimeError(f"gpuq job {job.job_id} ended {final['state']}: " + "; ".join(gpuq.explain(job.job_id)))
        return job.job_id


@dsl.pipeline(name="gpuq-train")
def pipeline(gpus: int = 8, max_runtime_s: int = 4 * 3600, project: str = "vision") -> None:
    gpuq_train(gpus=gpus, max_runtime_s=max_runtime_s, project=project)


if __name__ == "__main__":
    compiler.Compiler().compile(pipeline, "pipeline.yaml")

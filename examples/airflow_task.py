"""An Airflow DAG whose training step runs on gpuq's GPUs: the task submits the job with the producer SDK, waits for
it (the task's slot is held meanwhile; use a deferrable sensor on `status` for long jobs), and fails when the job
does. Airflow's retries then submit a new job.

Install `gpuq` in the Airflow workers' environment and give them GPUQ_API_URL and a team's GPUQ_TOKEN (an Airflow
connection or secret backend works as well: pass url= and token= to Client).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.decorators import dag, task
from airflow.exceptions import AirflowException

from gpuq_sdk import Client


@dag(schedule="@daily", start_date=datetime(2026, 1, 1), catchup=False, tags=["gpuq"])
def nightly_finetune() -> None:
    @task(retries=2, retry_delay=timedelta(minutes=10), execution_timeout=timedelta(hours=13))
    def train(ds: str | None = None) -> str:
        with Client() as gpuq:
            job = gpuq.submit(gpus=8, pods=2, max_runtime_s=12 * 3600, priority_class="normal",
                              labels={"project": "finetune", "airflow-run": ds or "manual"})
            final = gpuq.wait(job.job_id, timeout_s=13 * 3600, poll_s=30)
            if final["state"] != "completed":
                raise AirflowException(f"gpuq job {job.job_id} ended {final['state']}: "
                                       + "; ".join(gpuq.explain(job.job_id)))
            return job.job_id

    @task
    def evaluate(job_id: str) -> None:
        print(f"evaluating the checkpoint of {job_id}")

    evaluate(train())


nightly_finetune()

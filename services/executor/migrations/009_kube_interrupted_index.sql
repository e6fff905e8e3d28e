-- The jobs under a spot interruption notice, which the executor looks for every second: few, among many.
CREATE INDEX kube_jobs_interrupted ON executor.kube_jobs (job_id) WHERE interrupted_at IS NOT NULL;

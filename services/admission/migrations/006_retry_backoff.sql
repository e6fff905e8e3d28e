-- A job whose failed attempt its retry policy retries waits pending, outside the queue, until this time (epoch
-- seconds); admission's backoff timer then puts it back in its queue (BackoffAfterFailure in `gpuq explain`).
ALTER TABLE admission.jobs ADD COLUMN retry_not_before double precision;
CREATE INDEX admission_jobs_backoff ON admission.jobs (retry_not_before) WHERE retry_not_before IS NOT NULL;

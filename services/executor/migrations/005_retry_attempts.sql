-- Failed attempts a job's retry policy retried (services/pipeline/core/retry.py): the executor that saw the failures
-- counts them, in the same transaction that emits JobAttemptFailed or the final JobFailed, so a crash neither loses
-- nor double counts one.
ALTER TABLE executor.runs ADD COLUMN failures integer NOT NULL DEFAULT 0;
ALTER TABLE executor.kube_jobs ADD COLUMN failures integer NOT NULL DEFAULT 0;

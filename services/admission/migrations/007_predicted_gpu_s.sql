-- Duration-aware ordering (policy.duration_ordering): the predicted GPU-seconds a job was given when it was
-- received, kept so its place in the queue is the same after a restart or a requeue (NULL: no prediction).
ALTER TABLE admission.jobs ADD COLUMN predicted_gpu_s double precision;
-- The predictor's history is rebuilt at start from the most recent finished jobs that ran.
CREATE INDEX jobs_finished_runs ON admission.jobs (finished_at) WHERE status = 'finished' AND started_at IS NOT NULL;

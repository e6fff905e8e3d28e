-- Jobs admission cancelled: a JobPlaced that arrives after the job's JobCancelled is refused, never run.
CREATE TABLE executor.cancelled (
    job_id text PRIMARY KEY,
    at     double precision NOT NULL
);

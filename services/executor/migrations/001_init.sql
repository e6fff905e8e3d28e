-- The embedded simulated cluster's own state: what runs where, and until when.
CREATE TABLE executor.runs (
    job_id        text PRIMARY KEY,
    spec          jsonb NOT NULL,
    nodes         text[] NOT NULL,
    gpus          integer NOT NULL,
    status        text NOT NULL CHECK (status IN ('running', 'completed', 'failed', 'preempted', 'cancelled')),
    outcome       text,
    started_at    double precision NOT NULL,
    ends_at       double precision NOT NULL,
    done_s        double precision NOT NULL DEFAULT 0,   -- work saved by checkpoints across attempts
    attempt       integer NOT NULL DEFAULT 1,
    traceparent   text                                   -- the job's trace, continued by later events
);
CREATE INDEX runs_running_by_end ON executor.runs (ends_at) WHERE status = 'running';

CREATE TABLE executor.checkpoints (
    job_id        text NOT NULL,
    preemption_id text NOT NULL,
    due_at        double precision NOT NULL,
    done          boolean NOT NULL DEFAULT false,
    PRIMARY KEY (job_id, preemption_id)
);

CREATE TABLE executor.meta (
    key   text PRIMARY KEY,
    value text NOT NULL
);

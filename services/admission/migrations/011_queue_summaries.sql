-- Admission's read model of its queues, version 1: what `gpuq queues` and GET /v1/queues show per queue (nominal,
-- used, borrowed, lent, pending, running, the oldest pending job's submit time...), written by admission in the
-- transaction that changes its state (after each unit of work's admission cycle, the rows that changed), so that
-- a reader sees the committed state without rebuilding admission's memory from its jobs
-- (services/admission/queuemodel.py). Per-resource figures are JSON objects keyed by GPU model, in the core's
-- order (json, not jsonb, keeps it). Readers use the view, never the table: a column may be appended to v1;
-- anything else is a new version (v2_*) beside this one.
CREATE TABLE admission.queue_summaries (
    queue text PRIMARY KEY,
    cohort text,
    weight float8 NOT NULL,
    strategy text NOT NULL,
    nominal json NOT NULL,
    used json NOT NULL,
    borrowed json NOT NULL,
    lent json NOT NULL,
    pending integer NOT NULL,
    inadmissible integer NOT NULL,
    running integer NOT NULL,
    max_running_jobs integer,
    oldest_submitted_at float8
);

CREATE VIEW admission.v1_queues AS
SELECT queue,
       cohort,                                     -- NULL: the queue is in no cohort
       weight,                                     -- fair-share weight
       strategy,                                   -- StrictFIFO | BestEffortFIFO
       nominal,                                    -- {resource: GPUs} the queue's nominal quota
       used,                                       -- {resource: GPUs} held by its admitted jobs
       borrowed,                                   -- {resource: GPUs} used above nominal
       lent,                                       -- {resource: GPUs} its share of the cohort's borrowing
       pending,                                    -- jobs waiting for quota
       inadmissible,                               -- of those, jobs the configuration in force cannot admit
       running,                                    -- admitted jobs (quota reserved)
       max_running_jobs,                           -- NULL: no cap
       oldest_submitted_at                         -- epoch seconds; NULL when none pend
FROM admission.queue_summaries;

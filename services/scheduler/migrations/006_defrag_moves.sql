-- Defragmentation moves the scheduler asked for (docs/preemption.md, "Defragmentation"): one row per job per ask,
-- with its placement hint (the holes it consolidates into: bindings and per-binding (cpu_milli, memory_mib), as in
-- scheduler.holds). The scheduler plans its next moves with the last hour of them (its bound, each job's
-- cool-down, a gang's plan in flight), and holds the hint for the job once the preemption service preempted it.
CREATE TABLE IF NOT EXISTS scheduler.moves (
    job_id text NOT NULL,
    gang text NOT NULL,
    bindings jsonb NOT NULL,
    requests jsonb NOT NULL,
    asked_at double precision NOT NULL,
    PRIMARY KEY (job_id, asked_at)
);
CREATE INDEX IF NOT EXISTS moves_asked_at ON scheduler.moves (asked_at);

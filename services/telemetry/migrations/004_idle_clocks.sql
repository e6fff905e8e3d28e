-- Idle reclaim's clocks (services/core/idle): since when each running job's GPUs have been idle, their latest
-- samples, and when its owner was warned, so that a restart neither resets the idle time nor forgets a warning.
-- `version` only grows (the watch's change count): a write never replaces a newer clock with an older one.

CREATE TABLE telemetry.idle_clocks (
    job_id text PRIMARY KEY,
    version bigint NOT NULL,
    doc jsonb NOT NULL
);

-- Who holds which GPUs is the scheduler's fact, and a job's admission is admission's (one owner each, docs/
-- architecture.md "Who owns which fact"). The preemption service now reads the running jobs (spec, bindings,
-- placement, the executor-reported start) from the scheduler's read model (scheduler.v1_placements) and a
-- preemptor (spec, status, flavors) from admission's (admission.v1_jobs) when it decides, and consumes no job
-- event but JobCheckpointed. Its copy of the jobs goes; what is its own stays.

-- The last checkpoint each job reported (JobCheckpointed): no owner publishes it, and lost work counts from it.
CREATE TABLE preemption.checkpoints (
    job_id          text PRIMARY KEY,
    checkpointed_at double precision NOT NULL,
    uri             text
);
INSERT INTO preemption.checkpoints(job_id, checkpointed_at, uri)
SELECT job_id, last_checkpoint_at, last_checkpoint_uri FROM preemption.jobs WHERE last_checkpoint_at IS NOT NULL;

-- The run a protocol was opened for (the victim's placed_at in scheduler.v1_placements): a victim whose run ended,
-- or that holds a new placement since, is not preempted for it, and a victim preempted in this run is no candidate
-- while the scheduler has not freed its GPUs yet. NULL for protocols opened before this migration: the victim's
-- placement in force is taken.
ALTER TABLE preemption.preemptions ADD COLUMN victim_placed_at double precision;
-- A job's preemptions (cool-down: when it was last preempted; `gpuq explain`).
CREATE INDEX preemption_by_victim ON preemption.preemptions (victim, requested_at);

DROP TABLE preemption.jobs;

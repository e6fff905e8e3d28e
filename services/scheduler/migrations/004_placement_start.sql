-- The executor-reported start of each placed job's run (JobStarted.started_at), kept with the placement: the
-- scheduler already took it for the expected end, and preemption's protection window and lost work count from it.
-- NULL until JobStarted reached the scheduler (the placement time stands for it then), and again on each new
-- placement (a new run).
ALTER TABLE scheduler.jobs ADD COLUMN started_at double precision;

-- scheduler.v1_placements gains `started_at`, appended after the version-1 columns, whose names, types and
-- meaning stay: an additive column within v1 (CREATE OR REPLACE VIEW can only append), so the readers of the
-- other columns change nothing. A reader that needs `started_at` finds out whether the owner published it yet
-- (services/scheduler/readmodel.py), since during a rolling upgrade a new reader may meet an old scheduler.
CREATE OR REPLACE VIEW scheduler.v1_placements AS
SELECT job_id,
       spec,                                       -- the JobSpec as JSON
       flavors,                                    -- pod set -> GPU model, as admission assigned them
       bindings,                                   -- [GpuBinding] as JSON
       placed_at,
       coalesce(expected_end, placed_at + (spec ->> 'max_runtime_s')::double precision) AS expected_end,
       fencing_token,
       started_at                                  -- the executor-reported start of this run; NULL before it
FROM scheduler.jobs
WHERE status = 'placed';

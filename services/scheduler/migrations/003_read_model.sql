-- The cluster read model, version 1: the scheduler is the one owner of node facts (as the executors announce them:
-- spec, health and why it changed, removal) and of allocations (where each placed job runs, until when it is
-- expected to hold its GPUs). Other services read these views (services/scheduler/readmodel.py), never the tables
-- behind them, and keep no copy of their own: a change to the tables keeps the views' columns and meaning, and a
-- change to the views is a new version (v2_*) next to this one.

-- Why a node's health last changed (NodeChanged.reason / message, e.g. an XID from DCGM): part of the node fact.
ALTER TABLE scheduler.nodes ADD COLUMN reason text, ADD COLUMN message text;

-- Every node ever announced; a removed node keeps its row (`removed`) so that past allocations keep their model.
CREATE VIEW scheduler.v1_nodes AS
SELECT name,
       spec,                                       -- the NodeSpec as JSON (shared/domain.py)
       spec ->> 'gpu_model'       AS gpu_model,
       (spec ->> 'gpus')::integer AS gpus,
       spec ->> 'health'          AS health,
       removed,
       reason,
       message,
       updated_at                                  -- epoch seconds, the scheduler's clock
FROM scheduler.nodes;

-- Jobs holding GPUs now: the placement in force (bindings, the fencing token it was written under) and the end
-- the scheduler expects (placement + max_runtime_s, then start + max_runtime_s once JobStarted came).
CREATE VIEW scheduler.v1_placements AS
SELECT job_id,
       spec,                                       -- the JobSpec as JSON
       flavors,                                    -- pod set -> GPU model, as admission assigned them
       bindings,                                   -- [GpuBinding] as JSON
       placed_at,
       coalesce(expected_end, placed_at + (spec ->> 'max_runtime_s')::double precision) AS expected_end,
       fencing_token
FROM scheduler.jobs
WHERE status = 'placed';

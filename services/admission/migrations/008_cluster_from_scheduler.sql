-- The cluster is the scheduler's fact (one owner): ETAs read the nodes and every job's placement and expected end
-- from the scheduler's read model (scheduler.v1_nodes / v1_placements, services/scheduler/readmodel.py) at each
-- refresh, and admission no longer consumes NodeInventory / NodeChanged. Its copy of the nodes goes. (The
-- bindings, started_at and expected_end of admission.jobs stay: they are admission's record of its own jobs.)
DROP TABLE admission.nodes;

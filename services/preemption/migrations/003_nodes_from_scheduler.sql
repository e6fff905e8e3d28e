-- Nodes are the scheduler's fact (one owner): the what-if cluster is now built from its read model
-- (scheduler.v1_nodes, services/scheduler/readmodel.py) when a request is decided, and this service no longer
-- consumes NodeInventory / NodeChanged. Its copy goes.
DROP TABLE preemption.nodes;

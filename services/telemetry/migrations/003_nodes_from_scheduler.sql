-- Nodes are the scheduler's fact (one owner). Telemetry still folds NodeInventory / NodeChanged into its gauges as
-- they come, in memory, but keeps no copy: after a restart it takes the nodes, their health and why it changed
-- from the scheduler's read model (scheduler.v1_nodes, services/scheduler/readmodel.py).
DROP TABLE telemetry.nodes;

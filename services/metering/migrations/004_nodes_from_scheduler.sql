-- A node's GPU model is the scheduler's fact (one owner): reports read it from the scheduler's read model
-- (scheduler.v1_nodes, services/scheduler/readmodel.py), which keeps removed nodes, and metering no longer consumes
-- NodeInventory / NodeChanged. The model a utilisation sample names is the sample's own fact: it is kept with the
-- hourly usage it fed (first one wins), for nodes the scheduler never announced.
ALTER TABLE metering.usage_hourly ADD COLUMN gpu_model text;
-- What the old table knew (inventory or samples) stays with the usage already recorded.
UPDATE metering.usage_hourly u SET gpu_model = n.gpu_model FROM metering.nodes n WHERE n.node = u.node;
DROP TABLE metering.nodes;

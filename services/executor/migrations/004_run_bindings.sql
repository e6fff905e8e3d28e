-- Where each pod of a run is bound (JobPlaced's bindings): the DCGM source attributes GPU series to jobs by
-- (node, GPU index / MIG slice) and by the pods the simulated executor names after them.
ALTER TABLE executor.runs ADD COLUMN bindings jsonb NOT NULL DEFAULT '[]'::jsonb;

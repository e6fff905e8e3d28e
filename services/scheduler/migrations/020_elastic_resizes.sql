-- Elastic jobs resized while they run (issue 48, docs/scheduler.md "Elastic jobs"): the pods a placed elastic job
-- asked admission to be charged for (JobGrowRequested), until admission answers (JobResizeAdmitted). NULL: none
-- asked. The job's pods are its bindings.
ALTER TABLE scheduler.jobs ADD COLUMN IF NOT EXISTS grow_requested integer;

-- Elastic jobs resized while they run (issue 48, docs/admission.md): the pods an admitted elastic job is charged
-- for (NULL: its floor, what it was admitted with); a grow granted and not yet placed (JobResizeAdmitted, until the
-- scheduler's JobResized); and pods asked back for a job waiting for admission (until the scheduler took them).
ALTER TABLE admission.jobs ADD COLUMN IF NOT EXISTS charged_pods integer;
ALTER TABLE admission.jobs ADD COLUMN IF NOT EXISTS grow_granted integer;
ALTER TABLE admission.jobs ADD COLUMN IF NOT EXISTS asked_back integer;

-- Admission's job read model, version 1, with three columns appended (allowed by 009): when the job's last run
-- started and when the job finished (epoch seconds, admission's clock), and how it ended (Succeeded, Error, ...).
-- `gpuq export-trace` reads them to write the platform's own history as a simulator trace
-- (services/admission/runsmodel.py).
CREATE OR REPLACE VIEW admission.v1_jobs AS
SELECT job_id,
       queue,
       spec,
       status,
       flavors,
       submitted_at,
       started_at,                                 -- the start of its last run (NULL: never ran)
       finished_at,                                -- NULL while it waits or runs
       outcome                                     -- how it ended (ExitReason), NULL before
FROM admission.jobs;

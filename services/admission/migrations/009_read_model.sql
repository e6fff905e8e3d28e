-- A job's admission is admission's fact (docs/architecture.md, "Who owns which fact"). Its read model, version 1:
-- what other services read of a job's admission instead of folding JobSubmitted / JobAdmitted / JobRequeued /
-- the end events into a copy of their own. The preemption service reads a preemptor's spec, status and flavors
-- when it decides a request (services/admission/readmodel.py). Readers use this view, never admission.jobs: a
-- change to the table keeps the view's columns and meaning; a column may be appended to v1; anything else is a
-- new version (v2_*) beside this one.
CREATE VIEW admission.v1_jobs AS
SELECT job_id,
       queue,
       spec,                                       -- the JobSpec as JSON, as submitted
       status,                                     -- pending | admitted | finished | rejected
       flavors,                                    -- pod set -> GPU model while admitted (NULL otherwise)
       submitted_at                                -- epoch seconds (a requeued job keeps its original one)
FROM admission.jobs;

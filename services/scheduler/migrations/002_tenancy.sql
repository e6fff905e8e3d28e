-- Jobs admission cancelled. A cancel may reach the scheduler before the job's JobAdmitted (consumers of several
-- subjects see them in no fixed order): the row here keeps a later JobAdmitted from ever placing the job.
CREATE TABLE scheduler.cancelled (
    job_id text PRIMARY KEY,
    at     double precision NOT NULL
);

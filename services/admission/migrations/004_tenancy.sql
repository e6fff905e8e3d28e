-- Tenancy (docs/security.md): approvals, cancels that arrive before their job, and the verdict on each submission.
-- A job of a priority class that needs approval waits with approval = 'required' until an admin approves it.
ALTER TABLE admission.jobs ADD COLUMN approval text CHECK (approval IN ('required', 'approved'));
-- A cancel for a job admission does not know yet (its submission is still on the way): the job is cancelled the
-- moment that team submits it, so no later step ever runs it. Keyed by team: another team cannot pre-cancel it.
CREATE TABLE admission.tombstones (
    job_id       text NOT NULL,
    team         text NOT NULL,
    requested_at double precision NOT NULL,
    event_id     text NOT NULL,
    PRIMARY KEY (job_id, team)
);
-- One row per submission event: accepted, or refused and why (a duplicate job id is refused here; the job's row
-- is the first submission's). The API reads it to tell the submitter.
CREATE TABLE admission.submissions (
    event_id text PRIMARY KEY,
    job_id   text NOT NULL,
    team     text NOT NULL,
    verdict  text NOT NULL CHECK (verdict IN ('queued', 'rejected', 'cancelled', 'awaiting_approval')),
    reason   text,
    message  text,
    at       double precision NOT NULL
);
CREATE INDEX submissions_by_job ON admission.submissions (job_id);

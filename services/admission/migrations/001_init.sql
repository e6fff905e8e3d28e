-- Admission's own state: every job it has seen, its quota reservation, and why it waits.
CREATE TABLE admission.jobs (
    job_id        text PRIMARY KEY,
    team          text NOT NULL,
    queue         text NOT NULL,
    spec          jsonb NOT NULL,
    status        text NOT NULL CHECK (status IN ('pending', 'admitted', 'finished', 'rejected')),
    submitted_at  double precision NOT NULL,
    admitted_at   double precision,
    finished_at   double precision,
    flavors       jsonb,
    usage         jsonb,
    borrowing     boolean,
    reason        text,
    message       text,
    position_in_queue  integer,
    position_in_cohort integer,
    eta           double precision,
    resume_from   text,
    outcome       text
);
CREATE INDEX jobs_by_status ON admission.jobs (status, queue);

-- Who did what, when: rejections for authorisation, config changes.
CREATE TABLE admission.audit (
    id        bigserial PRIMARY KEY,
    at        double precision NOT NULL,
    actor     text NOT NULL,
    action    text NOT NULL,
    job_id    text,
    detail    jsonb NOT NULL DEFAULT '{}'
);

-- The queue configuration in force (latest row wins); refused changes are audited, not stored here.
CREATE TABLE admission.config (
    version    bigserial PRIMARY KEY,
    applied_at double precision NOT NULL,
    document   jsonb NOT NULL,
    applied_by text NOT NULL
);

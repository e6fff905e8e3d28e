-- The scheduler owns the cluster's allocation state: nodes as announced, and every admitted job's placement.
CREATE TABLE scheduler.nodes (
    name        text PRIMARY KEY,
    spec        jsonb NOT NULL,
    removed     boolean NOT NULL DEFAULT false,
    updated_at  double precision NOT NULL
);

CREATE TABLE scheduler.jobs (
    job_id        text PRIMARY KEY,
    spec          jsonb NOT NULL,
    flavors       jsonb NOT NULL DEFAULT '{}',
    status        text NOT NULL CHECK (status IN ('waiting', 'placed', 'finished')),
    admitted_at   double precision NOT NULL,
    placed_at     double precision,
    expected_end  double precision,
    bindings      jsonb,
    racks_spanned integer,
    blocks_spanned integer,
    fencing_token bigint,
    reason        text,
    message       text,
    planned_start double precision,
    resume_from   text
);
CREATE INDEX sched_jobs_by_status ON scheduler.jobs (status, admitted_at);

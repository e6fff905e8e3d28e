-- The preemption service's own view of the cluster and the persisted checkpoint-before-preempt protocol.

-- Queue configuration in force (the file at start, then every QueueConfigChanged).
CREATE TABLE preemption.config (
    version     bigserial PRIMARY KEY,
    applied_at  double precision NOT NULL,
    document    jsonb NOT NULL
);

-- Nodes as announced (NodeInventory / NodeChanged): the what-if ClusterState is rebuilt from them.
CREATE TABLE preemption.nodes (
    name     text PRIMARY KEY,
    spec     jsonb NOT NULL,
    removed  boolean NOT NULL DEFAULT false
);

-- Every job we heard of: specs of preemptors (submitted/admitted) and running jobs (possible victims).
CREATE TABLE preemption.jobs (
    job_id              text PRIMARY KEY,
    spec                jsonb NOT NULL,
    queue               text NOT NULL,
    status              text NOT NULL CHECK (status IN ('submitted', 'admitted', 'placed', 'running',
                                                         'preempting', 'preempted', 'finished')),
    allowed_models      jsonb NOT NULL DEFAULT '[]',
    bindings            jsonb,
    placed_at           double precision,
    started_at          double precision,
    last_checkpoint_at  double precision,
    last_checkpoint_uri text,
    last_preempted_at   double precision
);
CREATE INDEX preemption_jobs_by_status ON preemption.jobs (status, queue);

-- One row per PreemptionRequested: what became of it and why.
CREATE TABLE preemption.requests (
    preemption_id  text PRIMARY KEY,
    preemptor      text NOT NULL,
    queue          text NOT NULL,
    reason         text NOT NULL,
    need           jsonb NOT NULL DEFAULT '{}',
    requested_at   double precision NOT NULL,
    outcome        text NOT NULL,
    message        text NOT NULL DEFAULT '',
    victims        text[] NOT NULL DEFAULT '{}'
);
CREATE INDEX preemption_requests_by_preemptor ON preemption.requests (preemptor, requested_at);

-- The protocol and the record of every preemption: one row per victim.
-- checkpointing -> preempted (JobPreempted emitted) | aborted (victim ended, or preemptor placed/ended first).
CREATE TABLE preemption.preemptions (
    preemption_id        text NOT NULL REFERENCES preemption.requests (preemption_id),
    victim               text NOT NULL,
    preemptor            text NOT NULL,
    reason               text NOT NULL,
    queue                text NOT NULL,       -- the preemptor's queue (charged by the rate limit)
    victim_queue         text NOT NULL,
    gpus                 double precision NOT NULL,
    state                text NOT NULL CHECK (state IN ('checkpointing', 'preempted', 'aborted')),
    requested_at         double precision NOT NULL,
    deadline             double precision NOT NULL,
    estimated_lost_gpu_seconds double precision NOT NULL,
    checkpointed_at      double precision,
    checkpoint_uri       text,
    checkpoint_step      bigint,
    preempted_at         double precision,
    lost_gpu_seconds     double precision,
    abort_reason         text,
    PRIMARY KEY (preemption_id, victim)
);
-- A job is in at most one open protocol: a restart or a second request can never preempt it twice.
CREATE UNIQUE INDEX preemption_one_open_per_victim ON preemption.preemptions (victim) WHERE state = 'checkpointing';
CREATE INDEX preemption_open_deadlines ON preemption.preemptions (deadline) WHERE state = 'checkpointing';
CREATE INDEX preemption_by_queue_time ON preemption.preemptions (queue, requested_at);

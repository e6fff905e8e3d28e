-- The Kubernetes executor's state (services/executor/kube). The simulated executor does not use these tables.
CREATE TABLE executor.kube_jobs (
    job_id          text PRIMARY KEY,
    job_label       text NOT NULL UNIQUE,           -- gpuq.io/job on its pods
    origin          text NOT NULL CHECK (origin IN ('cluster', 'event')),
    api_version     text NOT NULL,
    kind            text NOT NULL,
    namespace       text NOT NULL,
    name            text NOT NULL,
    uid             text UNIQUE,
    spec            jsonb NOT NULL,
    templates       jsonb NOT NULL,                 -- pod set -> pod template as the user wrote it
    state           text NOT NULL CHECK (state IN ('queued', 'deferred', 'placed', 'running', 'suspended',
                                                   'completed', 'failed', 'cancelled', 'rejected')),
    attempt         integer NOT NULL DEFAULT 0,     -- placements run so far
    placement       jsonb,                          -- bindings of the current placement
    resume_from     text,
    placed_at       double precision,
    started_at      double precision,
    requeues        integer NOT NULL DEFAULT 0,     -- PodsReady timeouts and failed bindings so far
    backoff_until   double precision,
    last_checkpoint text,
    preemption_id   text,
    failure         jsonb,                          -- first pod failure of this attempt: {reason, message}
    pull_problem_at double precision,               -- since when an image cannot be pulled
    unbound_at      double precision,               -- since when a pod cannot bind where it was placed
    unbound_message text,
    last_notice     text,                           -- the last Kubernetes Event (reason + message), not repeated
    traceparent     text
);
CREATE INDEX kube_jobs_active ON executor.kube_jobs (state) WHERE state IN ('deferred', 'placed', 'running');

-- Workloads gpuq saw and would not take (an Event said why once).
CREATE TABLE executor.kube_refused (
    uid     text PRIMARY KEY,
    reason  text NOT NULL,
    message text NOT NULL,
    at      double precision NOT NULL
);

-- Nodes as last announced (NodeInventory / NodeChanged), to announce only real changes.
CREATE TABLE executor.kube_nodes (
    name    text PRIMARY KEY,
    spec    jsonb NOT NULL
);

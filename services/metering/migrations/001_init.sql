-- Metering ledger. Every quantity is an integer (ms, GPU-ms, milli-GPUs, millijoules) so sums are exact
-- and independent of event order; see services/metering/core/units.py.

-- Who a job is (from JobPlaced's spec): the dimensions reports group by.
CREATE TABLE metering.jobs (
    job_id          text PRIMARY KEY,
    team            text NOT NULL,
    queue           text NOT NULL,
    priority_class  text NOT NULL,
    kind            text NOT NULL,
    user_name       text,
    labels          jsonb NOT NULL DEFAULT '{}'::jsonb,
    spec_at         timestamptz NOT NULL   -- placement the dimensions come from: the earliest one wins
);

-- Lifecycle facts, deduplicated by what they say (not by event id): a fact delivered twice is one fact.
CREATE TABLE metering.job_facts (
    job_id  text NOT NULL,
    kind    text NOT NULL CHECK (kind IN ('placed', 'started', 'completed', 'failed', 'cancelled', 'preempted')),
    at      timestamptz NOT NULL,
    detail  jsonb NOT NULL DEFAULT '{}'::jsonb,
    PRIMARY KEY (job_id, kind, at)
);
CREATE INDEX job_facts_at ON metering.job_facts (at);

-- Allocation segments per node, rebuilt for a job from all its facts whenever one is added.
CREATE TABLE metering.allocations (
    job_id      text NOT NULL,
    placed_at   timestamptz NOT NULL,
    node        text NOT NULL,             -- '' for lost work of a preemption whose placement is unknown
    milli_gpus  integer NOT NULL CHECK (milli_gpus >= 0),
    model_hint  text,
    started_at  timestamptz,
    ended_at    timestamptz,               -- NULL = still allocated
    end_kind    text,
    lost_ms     bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (job_id, placed_at, node)
);
CREATE INDEX allocations_window ON metering.allocations (placed_at, ended_at);

-- GPU model per node (NodeInventory / NodeChanged, or the model a UtilizationSampled names).
CREATE TABLE metering.nodes (
    node        text PRIMARY KEY,
    gpu_model   text NOT NULL,
    source      text NOT NULL
);

-- Raw GPU samples, keyed by what they measure: a redelivered sample is a no-op (ON CONFLICT DO NOTHING).
-- Kept at least as long as the utilisation stream's max age so a redelivery is always recognised.
CREATE TABLE metering.gpu_samples (
    node             text NOT NULL,
    gpu_index        integer NOT NULL,
    sampled_at       timestamptz NOT NULL,
    job_id           text,
    interval_ms      integer NOT NULL,
    utilization_pct  real NOT NULL,
    memory_used_mib  integer NOT NULL,
    power_w          real NOT NULL,
    temperature_c    real,
    used_gpu_ms      bigint NOT NULL,
    energy_mj        bigint NOT NULL,
    PRIMARY KEY (node, gpu_index, sampled_at)
);

-- Hourly usage per job and node, incremented only by samples that were actually inserted.
CREATE TABLE metering.usage_hourly (
    job_id          text NOT NULL,
    node            text NOT NULL,
    hour            timestamptz NOT NULL,
    samples         bigint NOT NULL,
    sampled_gpu_ms  bigint NOT NULL,
    used_gpu_ms     bigint NOT NULL,
    energy_mj       bigint NOT NULL,
    last_sample_at  timestamptz NOT NULL,
    PRIMARY KEY (job_id, node, hour)
);
CREATE INDEX usage_hourly_hour ON metering.usage_hourly (hour);

-- Price list (cost_per_gpu_hour per GPU model) from queues.yaml's gpu_flavors.
CREATE TABLE metering.rates (
    gpu_model          text PRIMARY KEY,
    cost_per_gpu_hour  double precision NOT NULL CHECK (cost_per_gpu_hour >= 0),
    set_at             timestamptz NOT NULL
);

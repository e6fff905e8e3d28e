-- Fair share over time (queues.yaml policy.usage_half_life_s): the half-life metering decays each queue's usage
-- with when it publishes its read model, QueueUsageReported. One row, replaced by the latest queue configuration;
-- NULL = the policy is off and nothing is published.
CREATE TABLE metering.usage_policy (
    id           integer PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    half_life_s  double precision CHECK (half_life_s > 0),
    set_at       timestamptz NOT NULL
);

-- Telemetry state behind the gauges (rebuilt into memory at start), and webhook subscriptions/deliveries.

CREATE TABLE telemetry.jobs (
    job_id text PRIMARY KEY,
    doc jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE telemetry.nodes (
    name text PRIMARY KEY,
    doc jsonb NOT NULL
);

-- The latest utilisation sample of each node.
CREATE TABLE telemetry.samples (
    node text PRIMARY KEY,
    doc jsonb NOT NULL
);

-- Small documents such as the last queues.yaml seen (for guaranteed quota and prices).
CREATE TABLE telemetry.settings (
    key text PRIMARY KEY,
    doc jsonb NOT NULL
);

CREATE TABLE telemetry.webhook_subscriptions (
    id text PRIMARY KEY,
    url text NOT NULL,
    team text,                       -- NULL: every team (platform-wide)
    event_types text[] NOT NULL,     -- short names (job.completed) or '*'
    secret text NOT NULL,            -- whsec_...
    active boolean NOT NULL DEFAULT true,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE telemetry.webhook_deliveries (
    id bigserial PRIMARY KEY,
    subscription_id text NOT NULL REFERENCES telemetry.webhook_subscriptions(id) ON DELETE CASCADE,
    event_id text NOT NULL,          -- the CloudEvent id = webhook-id: receivers de-duplicate on it
    event_type text NOT NULL,
    body bytea NOT NULL,             -- exactly the bytes signed and sent on every attempt
    status text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'delivered', 'dead')),
    attempts integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL,
    last_status integer,
    last_error text,
    created_at timestamptz NOT NULL DEFAULT now(),
    delivered_at timestamptz,
    UNIQUE (subscription_id, event_id)
);
CREATE INDEX webhook_deliveries_due ON telemetry.webhook_deliveries (next_attempt_at) WHERE status = 'pending';

-- One record per delivery given up on; kept when the subscription is removed.
CREATE TABLE telemetry.webhook_dead_letters (
    delivery_id bigint PRIMARY KEY,
    subscription_id text NOT NULL,
    event_id text NOT NULL,
    event_type text NOT NULL,
    attempts integer NOT NULL,
    last_error text NOT NULL,
    last_status integer,
    dead_at timestamptz NOT NULL
);

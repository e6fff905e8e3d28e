-- What admission needs for ETAs (forward simulation with the production cores): the cluster's nodes and
-- where admitted jobs run and until when they are expected to hold their GPUs.
CREATE TABLE admission.nodes (
    name     text PRIMARY KEY,
    spec     jsonb NOT NULL,
    removed  boolean NOT NULL DEFAULT false
);
ALTER TABLE admission.jobs ADD COLUMN bindings jsonb;
ALTER TABLE admission.jobs ADD COLUMN started_at double precision;
ALTER TABLE admission.jobs ADD COLUMN expected_end double precision;

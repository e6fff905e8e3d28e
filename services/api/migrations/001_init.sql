-- Bearer tokens of the API: each maps to a team, or to the platform-admin role. Only a hash of the secret is kept.
CREATE TABLE api.tokens (
    id          text PRIMARY KEY,               -- the public part of the token (gpuq_<id>.<secret>)
    name        text NOT NULL,                  -- who holds it (audited as token:<name> or admin:<name>)
    team        text,                           -- NULL for an admin token
    role        text NOT NULL CHECK (role IN ('team', 'admin')),
    secret_hash bytea NOT NULL,                 -- SHA-256 of the secret part
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz,
    revoked_at  timestamptz,
    CHECK ((role = 'team') = (team IS NOT NULL))
);

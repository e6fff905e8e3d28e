-- Standard Webhooks: secret rotation without downtime (the previous secret signs too until it expires), and
-- subscriptions disabled by their receiver (410 Gone) with the reason, kept so they can be re-enabled.

ALTER TABLE telemetry.webhook_subscriptions
    ADD COLUMN previous_secret text,                  -- still signs until previous_secret_expires_at
    ADD COLUMN previous_secret_expires_at timestamptz,
    ADD COLUMN disabled_reason text,                  -- why active became false (NULL while active)
    ADD COLUMN disabled_at timestamptz;

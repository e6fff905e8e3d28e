-- Requests that found no victim only because every candidate was inside its protection window (ProtectedJustStarted).
-- The service re-runs the request at retry_at (the earliest end of protection) under the protocol id
-- `<original id>/retry-<attempt>`; at most one per preemptor: a newer request replaces it, and it is dropped when
-- the preemptor is placed, ends, or is no longer waiting.
CREATE TABLE preemption.deferred (
    preemptor      text PRIMARY KEY,
    preemption_id  text NOT NULL,             -- the original request's event id
    attempt        integer NOT NULL,          -- retries run so far
    payload        jsonb NOT NULL,            -- the PreemptionRequested, as received
    retry_at       double precision NOT NULL
);
CREATE INDEX preemption_deferred_due ON preemption.deferred (retry_at);

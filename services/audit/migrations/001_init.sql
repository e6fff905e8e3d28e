-- The platform's audit trail: one row per AuditRecorded event, written only by the audit service, never changed.
CREATE TABLE audit.records (
    id        bigserial PRIMARY KEY,
    event_id  text NOT NULL UNIQUE,      -- the AuditRecorded event's id (a redelivery adds nothing)
    recorder  text NOT NULL,             -- the service that recorded it: the subject's token, not the payload's
    at        timestamptz NOT NULL,      -- when the recorder did it (its clock)
    action    text NOT NULL,
    actor     text NOT NULL,             -- authenticated identity: team:<team>, token:<name>, admin:<name>, service:<name>
    team      text,
    job_id    text,
    detail    jsonb NOT NULL DEFAULT '{}',
    stored_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX records_by_time ON audit.records (at, id);
CREATE INDEX records_by_team ON audit.records (team, at);

-- Append-only: rows are never updated or deleted, whoever asks (a role that may drop the trigger is an admin).
CREATE FUNCTION audit.refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit.records is append-only: % refused', TG_OP;
END $$;
CREATE TRIGGER records_append_only BEFORE UPDATE OR DELETE ON audit.records
    FOR EACH ROW EXECUTE FUNCTION audit.refuse_change();
CREATE TRIGGER records_no_truncate BEFORE TRUNCATE ON audit.records
    FOR EACH STATEMENT EXECUTE FUNCTION audit.refuse_change();

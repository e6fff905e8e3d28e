-- The audit trail, partitioned by the month of `at` (UTC), so that records past their legal window go a whole month
-- at a time (DROP of a partition: no row is ever updated or deleted, and the append-only triggers stay as they are).
-- docs/install.md, "Backups and retention".
--
-- The existing table is converted in place, not copied: it is renamed `audit.records_legacy` and attached as the
-- first partition, covering every time before the month after its newest record (nothing, when it is empty). Its
-- rows are not rewritten or moved (a move would be a DELETE, which its trigger refuses, or a DROP of the old table,
-- which must wait for a later release); it is dropped whole, like any month, once its newest month is past the
-- window. Attaching checks its rows against the bound and builds the one index the partitioned table needs that it
-- lacks, (event_id, at) (one scan each), inside this migration's transaction; its two others are reused.
--
-- Expand/contract (docs/install.md, "Upgrades while two releases run"): no table, column or row is dropped, and
-- the name readers use stays `audit.records`, so every reader of the previous release (`gpuq audit`, the API) keeps
-- working on the partitioned table. The one thing the previous release cannot do on it is insert: its
-- `ON CONFLICT (event_id)` names a uniqueness that a table partitioned by time cannot have (it is now
-- (event_id, at): a redelivered record carries its event id and its time). While the previous audit service still
-- runs beside the new one during a rollout, its inserts fail and its messages are redelivered (eight deliveries
-- over about a minute of back-off) until the new one stores them: delayed, not lost.

ALTER TABLE audit.records RENAME TO records_legacy;
ALTER TABLE audit.records_legacy RENAME CONSTRAINT records_pkey TO records_legacy_pkey;
ALTER TABLE audit.records_legacy RENAME CONSTRAINT records_event_id_key TO records_legacy_event_id_key;
ALTER INDEX audit.records_by_time RENAME TO records_legacy_by_time;
ALTER INDEX audit.records_by_team RENAME TO records_legacy_by_team;
-- The partitioned table's own triggers are cloned onto every partition under their names.
ALTER TRIGGER records_append_only ON audit.records_legacy RENAME TO records_legacy_append_only;
ALTER TRIGGER records_no_truncate ON audit.records_legacy RENAME TO records_legacy_no_truncate;

CREATE TABLE audit.records (
    id        bigint NOT NULL DEFAULT nextval('audit.records_id_seq'),
    event_id  text NOT NULL,             -- the AuditRecorded event's id (a redelivery adds nothing)
    recorder  text NOT NULL,             -- the service that recorded it: the subject's token, not the payload's
    at        timestamptz NOT NULL,      -- when the recorder did it (its clock): the partition key
    action    text NOT NULL,
    actor     text NOT NULL,             -- authenticated identity: team:<team>, token:<name>, admin:<name>, service:<name>
    team      text,
    job_id    text,
    detail    jsonb NOT NULL DEFAULT '{}',
    stored_at timestamptz NOT NULL DEFAULT now(),
    -- A record's key. Not a primary key: the legacy partition keeps its own (id), and a table has one at most.
    UNIQUE (event_id, at)
) PARTITION BY RANGE (at);
-- The ids go on from the old table's sequence, which now belongs to the partitioned table (dropping the legacy
-- partition one day must not take the sequence with it).
ALTER SEQUENCE audit.records_id_seq OWNED BY audit.records.id;
CREATE INDEX records_by_time ON audit.records (at, id);
CREATE INDEX records_by_team ON audit.records (team, at);

DO $$
DECLARE
    newest timestamptz := (SELECT max(at) FROM audit.records_legacy);
    -- months are computed on UTC wall time, whatever the session's time zone
    upto timestamptz := COALESCE((date_trunc('month', newest AT TIME ZONE 'UTC') + interval '1 month')
                                 AT TIME ZONE 'UTC', '-infinity');
BEGIN
    EXECUTE format('ALTER TABLE audit.records ATTACH PARTITION audit.records_legacy FOR VALUES FROM (MINVALUE) TO (%L)',
                   upto);
END $$;

-- Append-only, as before, for every partition: row triggers on the partitioned table are cloned onto each one
-- (the legacy partition keeps its own as well). TRUNCATE triggers are not cloned: audit.ensure_partition gives
-- each new month its own.
CREATE TRIGGER records_append_only BEFORE UPDATE OR DELETE ON audit.records
    FOR EACH ROW EXECUTE FUNCTION audit.refuse_change();
CREATE TRIGGER records_no_truncate BEFORE TRUNCATE ON audit.records
    FOR EACH STATEMENT EXECUTE FUNCTION audit.refuse_change();

-- The partitions and their bounds (lower NULL: from the beginning of time), read from the catalog.
CREATE VIEW audit.partitions AS
SELECT c.relname::text AS name,
       substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \(''([^'']*)''\)')::timestamptz AS lower,
       substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \(''([^'']*)''\)')::timestamptz AS upper
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'audit.records'::regclass;

-- The partition that holds `for_at`, created (its month, UTC) when no partition does; returns the name it created,
-- NULL when there was one. The audit service calls it before the first record of a month it has not seen, and its
-- retention loop for this month and the next, so a month's partition is normally there before its first record.
CREATE FUNCTION audit.ensure_partition(for_at timestamptz) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    month_start timestamp := date_trunc('month', for_at AT TIME ZONE 'UTC');
    part text := 'records_' || to_char(month_start, 'YYYY_MM');
BEGIN
    IF EXISTS (SELECT 1 FROM audit.partitions p WHERE (p.lower IS NULL OR p.lower <= for_at) AND for_at < p.upper) THEN
        RETURN NULL;
    END IF;
    -- One creator at a time (the service, its retention loop, `gpuq retention`); this mode lets inserts and reads on.
    LOCK TABLE audit.records IN SHARE UPDATE EXCLUSIVE MODE;
    IF EXISTS (SELECT 1 FROM audit.partitions p WHERE (p.lower IS NULL OR p.lower <= for_at) AND for_at < p.upper) THEN
        RETURN NULL;
    END IF;
    EXECUTE format('CREATE TABLE audit.%I PARTITION OF audit.records FOR VALUES FROM (%L) TO (%L)', part,
                   month_start AT TIME ZONE 'UTC', (month_start + interval '1 month') AT TIME ZONE 'UTC');
    EXECUTE format('CREATE TRIGGER records_no_truncate BEFORE TRUNCATE ON audit.%I '
                   'FOR EACH STATEMENT EXECUTE FUNCTION audit.refuse_change()', part);
    RETURN part;
END $$;

-- Retention: drop every partition whose records all lie before `cutoff` (its upper bound is at or before it), oldest
-- first; returns their names. A whole month at a time, never a row. The database's own floor: a partition that ended
-- less than 30 days ago is never dropped, whatever the caller asks (a wrong setting or clock cannot empty the trail).
CREATE FUNCTION audit.drop_partitions_before(cutoff timestamptz) RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    part text;
BEGIN
    IF cutoff > now() - interval '30 days' THEN
        RAISE EXCEPTION 'audit records are kept at least 30 days: refusing to drop partitions ending before % '
                        '(later than %)', cutoff, now() - interval '30 days';
    END IF;
    FOR part IN SELECT p.name FROM audit.partitions p WHERE p.upper <= cutoff ORDER BY p.upper LOOP
        EXECUTE format('DROP TABLE audit.%I', part);
        RETURN NEXT part;
    END LOOP;
END $$;

SELECT audit.ensure_partition(now());
SELECT audit.ensure_partition(now() + interval '1 month');

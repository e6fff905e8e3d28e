-- Several admission instances (one per cohort set) share these tables. Each applies every QueueConfigChanged;
-- the first records it, keyed by the event id, so the others (and a new instance replaying the stream) know it
-- is in force and do not record it again.
ALTER TABLE admission.config ADD COLUMN event_id text UNIQUE;

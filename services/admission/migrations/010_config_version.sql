-- One source of configuration (docs/admission.md, "The configuration in force"). Admission owns the queue
-- configuration; a version is its number (only grows) and its content's hash (sha256 of the normalized document,
-- shared.config.queues_hash), so that the same content proposed twice (several instances starting with the same
-- file, a command repeated) is one version, and an earlier version's file (an old pod in a rolling upgrade) is
-- recognised. Hashes of versions recorded before this migration are filled in by admission at its next start.
ALTER TABLE admission.config ADD COLUMN hash text;
-- file: a queues.yaml read at start; change: a QueueConfigChanged proposal (gpuq apply-queues, the API).
ALTER TABLE admission.config ADD COLUMN source text;
CREATE INDEX admission_config_by_hash ON admission.config (hash, version);

-- The read model other services read the version in force from (services/admission/configmodel.py), instead of
-- keeping a copy of their own. Version 1: its columns keep their name, type and meaning; a column may be appended.
CREATE VIEW admission.v1_config AS
SELECT version,                                    -- only grows; the newest is in force
       hash,                                       -- sha256 of the normalized document (NULL until filled in)
       document,                                   -- the queues.yaml document, normalized
       applied_at,                                 -- epoch seconds, admission's clock
       applied_by,                                 -- who proposed it (an actor; "file" for a queues.yaml at start)
       source                                      -- file | change (NULL: recorded before sources were)
FROM admission.config;

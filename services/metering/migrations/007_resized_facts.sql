-- An elastic job's resize while it runs (JobResized, issue 48) is a fact of its own: its allocation goes on with the
-- pods it has after the resize (services/core/metering/segments.py, FactKind.RESIZED).
ALTER TABLE metering.job_facts DROP CONSTRAINT IF EXISTS job_facts_kind_check;
ALTER TABLE metering.job_facts ADD CONSTRAINT job_facts_kind_check
    CHECK (kind IN ('placed', 'started', 'completed', 'failed', 'cancelled', 'preempted', 'resized'));

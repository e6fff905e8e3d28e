-- Capacity freed by a preemption, held for the preemptor that asked for it (issue 51): until the preemptor is
-- placed, ends, or `until` passes, no other job is placed on it. One row per victim whose JobPreempted freed it;
-- the victim's bindings and per-binding (cpu_milli, memory_mib) are kept here because its own row is rewritten
-- when it is admitted again.
CREATE TABLE IF NOT EXISTS scheduler.holds (
    victim text PRIMARY KEY,
    preemptor text NOT NULL,
    bindings jsonb NOT NULL,
    requests jsonb NOT NULL,
    until double precision NOT NULL
);
CREATE INDEX IF NOT EXISTS holds_preemptor ON scheduler.holds (preemptor);

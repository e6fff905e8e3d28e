-- The ETA's range: p10 and p90 of the expected start (epoch seconds), next to the most likely start (eta).
ALTER TABLE admission.jobs ADD COLUMN eta_low double precision;
ALTER TABLE admission.jobs ADD COLUMN eta_high double precision;

-- Retention (shared/retention.py): raw samples older than GPUQ_METERING_RAW_RETENTION_DAYS are deleted in batches,
-- found by their time. A BRIN index: samples arrive in time order, so it stays a few pages and costs the sample
-- insert path almost nothing, where a B-tree on sampled_at would be another index written per sample.
CREATE INDEX gpu_samples_by_time ON metering.gpu_samples USING brin (sampled_at);

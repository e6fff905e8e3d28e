-- Samples from dcgm-exporter: a MIG-partitioned GPU has one sample per GPU instance (DCGM's GPU_I_ID), so the
-- instance joins the key (-1 = a whole GPU); a MIG sample counts its slice's share of a GPU (milli_gpus) in
-- used and sampled GPU time; `approximate` marks samples attributed by a node-level split.
ALTER TABLE metering.gpu_samples
    ADD COLUMN gpu_instance integer NOT NULL DEFAULT -1,
    ADD COLUMN milli_gpus integer NOT NULL DEFAULT 1000 CHECK (milli_gpus BETWEEN 0 AND 1000),
    ADD COLUMN approximate boolean NOT NULL DEFAULT false;
ALTER TABLE metering.gpu_samples DROP CONSTRAINT gpu_samples_pkey;
ALTER TABLE metering.gpu_samples ADD PRIMARY KEY (node, gpu_index, gpu_instance, sampled_at);

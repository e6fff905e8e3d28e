-- Capacity asked of the cluster-autoscaler (services/executor/kube/provisioning.py): the job's current
-- ProvisioningRequest and what the autoscaler answered; `gpuq explain` reads it (services/api/readmodel.py).
CREATE TABLE executor.kube_provisioning (
    job_id       text PRIMARY KEY,
    namespace    text NOT NULL,
    name         text NOT NULL,                 -- the current request (<workload>-gpuq-<attempt>)
    class_name   text NOT NULL,
    attempt      integer NOT NULL,
    state        text NOT NULL CHECK (state IN ('requested', 'provisioned', 'failed', 'released')),
    reason       text,
    message      text,
    requested_at double precision NOT NULL,
    retry_at     double precision,              -- failed: when it may ask again; NULL: not again
    wants        boolean NOT NULL DEFAULT true  -- the job's last pending status asked for capacity
);
-- Scale-down: since when gpuq has held no job on a node (its cool-down counts from then).
CREATE TABLE executor.kube_node_idle (
    node  text PRIMARY KEY,
    since double precision NOT NULL
);

-- The end gpuq gave a job that failed or was rejected ({reason, message}): written onto its workload, once the
-- workload's controller has stopped it, as a Failed condition or status that kubectl and Kueue-aware tools read
-- (services/executor/kube/app.py, `_conclude`).
ALTER TABLE executor.kube_jobs ADD COLUMN ending jsonb;

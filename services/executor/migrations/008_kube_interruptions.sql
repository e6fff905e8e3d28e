-- Spot interruption notices (services/executor/kube/interruptions.py): when a job's node got its notice, what the
-- notice was, and the job's last checkpoint then (a newer one is the checkpoint asked for on the notice).
ALTER TABLE executor.kube_jobs ADD COLUMN interrupted_at double precision;
ALTER TABLE executor.kube_jobs ADD COLUMN interruption text;
ALTER TABLE executor.kube_jobs ADD COLUMN checkpoint_at_notice text;

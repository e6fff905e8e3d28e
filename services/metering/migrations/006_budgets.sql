-- GPU-hour budgets (queues.yaml `budgets`, docs/admission.md "GPU-hour budgets"): metering's read model of each
-- budgeted team's use in its current period, rewritten every few minutes of platform time from the ledger. Admission
-- reads it (through the view) to judge new work at 100%; `gpuq budget` and telemetry's gauges show it.
CREATE TABLE metering.budget_status (
    team                text PRIMARY KEY,
    period              text NOT NULL,              -- 2026-12 or 2026-Q4
    period_start        timestamptz NOT NULL,
    period_end          timestamptz NOT NULL,
    budget_gpu_hours    double precision NOT NULL CHECK (budget_gpu_hours > 0),
    used_gpu_hours      double precision NOT NULL CHECK (used_gpu_hours >= 0),
    forecast_gpu_hours  double precision NOT NULL CHECK (forecast_gpu_hours >= 0),
    warn_at             double precision NOT NULL,
    on_exhausted        text NOT NULL,
    state               text NOT NULL CHECK (state IN ('ok', 'warning', 'exhausted')),
    reported_at         timestamptz NOT NULL
);

-- Version 1 of the read model other services use (services/metering/budgetmodel.py).
CREATE VIEW metering.v1_budgets AS
    SELECT team, period, period_start, period_end, budget_gpu_hours, used_gpu_hours, forecast_gpu_hours, warn_at,
           on_exhausted, state, reported_at
      FROM metering.budget_status;

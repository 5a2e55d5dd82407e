-- Each maintenance step's last success and last failure, so that
-- `reliability status` can say when a job last ran without a metrics
-- server (the gauge maintenance_last_success_timestamp_seconds says the
-- same to Prometheus). Written by the owner role that runs maintenance.
CREATE TABLE maintenance_runs (
    step            text        PRIMARY KEY,
    last_success_at timestamptz,
    last_failure_at timestamptz,
    last_error      text
);

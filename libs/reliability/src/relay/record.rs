//! What the broker's answers do to the outbox rows of a batch, inside the
//! claim's transaction: confirmed rows processed, nacked rows deferred,
//! refused rows backed off or moved to the DLQ table.

use std::time::Duration;

use crate::Result;

use super::RelayConfig;

pub(super) async fn mark_processed(tx: &mut sqlx::PgConnection, ids: &[i64]) -> Result<()> {
    if !ids.is_empty() {
        sqlx::query("UPDATE outbox_messages SET processed_at = now() WHERE id = ANY($1)")
            .bind(ids)
            .execute(tx)
            .await?;
    }
    Ok(())
}

/// Moves the rows whose next attempt would exceed `max_attempts` to the DLQ
/// table; returns how many.
pub(super) async fn move_to_dlq(
    tx: &mut sqlx::PgConnection,
    ids: &[i64],
    errors: &[String],
    max_attempts: i32,
) -> Result<usize> {
    let moved = sqlx::query(
        "WITH failed AS (SELECT * FROM unnest($1::bigint[], $2::text[]) AS f(id, error)),
              moved AS (
                DELETE FROM outbox_messages o USING failed
                WHERE o.id = failed.id AND o.attempts + 1 > $3
                RETURNING o.*, failed.error)
         INSERT INTO outbox_messages_dlq
             (id, tenant_id, aggregate_type, aggregate_id, event_type, event_version,
              payload, headers, occurred_at, attempts, last_error, aggregate_seq)
         SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version,
                payload, headers, occurred_at, attempts + 1, error, aggregate_seq
         FROM moved",
    )
    .bind(ids)
    .bind(errors)
    .bind(max_attempts)
    .execute(tx)
    .await?;
    Ok(moved.rows_affected() as usize)
}

/// Nacked rows: due again after one backoff step, their attempts untouched.
pub(super) async fn defer(
    tx: &mut sqlx::PgConnection,
    ids: &[i64],
    errors: &[String],
    step: Duration,
) -> Result<()> {
    sqlx::query(
        "UPDATE outbox_messages o
         SET available_at = now() + make_interval(secs => $3), last_error = f.error
         FROM unnest($1::bigint[], $2::text[]) AS f(id, error)
         WHERE o.id = f.id",
    )
    .bind(ids)
    .bind(errors)
    .bind(step.as_secs_f64())
    .execute(tx)
    .await?;
    Ok(())
}

/// Backs the remaining failed rows off: `attempts + 1`, and due again after
/// `LEAST(attempts + 1, max_steps) * step`.
pub(super) async fn schedule_retry(
    tx: &mut sqlx::PgConnection,
    ids: &[i64],
    errors: &[String],
    config: &RelayConfig,
) -> Result<()> {
    sqlx::query(
        "UPDATE outbox_messages o
         SET attempts = o.attempts + 1,
             available_at = now() + LEAST(o.attempts + 1, $3) * make_interval(secs => $4),
             last_error = f.error
         FROM unnest($1::bigint[], $2::text[]) AS f(id, error)
         WHERE o.id = f.id",
    )
    .bind(ids)
    .bind(errors)
    .bind(config.backoff_max_steps)
    .bind(config.backoff_step.as_secs_f64())
    .execute(tx)
    .await?;
    Ok(())
}

//! Why an event was dead-lettered, kept beside the dead letter: the broker
//! carries only its own reason ("rejected"), and a queue's letters cannot
//! be grouped by the handler's error without it (ADR 0037). Written
//! before the reject, committed on its own; the operator's tools read it.

use crate::outbox::Envelope;
use crate::{TenantId, TenantTx};

use super::{Consumer, Handler, HandlerError, Pg};

/// An error's text is kept to this many characters: enough to group by
/// and to read, bounded against a handler that prints a payload.
const ERROR_CHARS: usize = 2000;

/// The kind of a handler's error, the first key letters are grouped by.
pub fn error_class(e: &HandlerError) -> String {
    match e {
        HandlerError::Decode(_) => "decode".into(),
        HandlerError::Permanent(_) => "permanent".into(),
        HandlerError::Transient(_) => "transient".into(),
        HandlerError::Database(sqlx::Error::Database(db)) => {
            format!("database {}", db.code().unwrap_or_default())
        }
        HandlerError::Database(_) => "database".into(),
        HandlerError::Unavailable(_) => "unavailable".into(),
        HandlerError::Reliability(_) => "library".into(),
    }
}

impl<H: Handler> Consumer<Pg<H>> {
    /// Keeps why `event` is being dead-lettered. Best effort: the letter
    /// goes to the DLQ whether or not this commits (its cause then shows
    /// as not recorded).
    pub(super) async fn record_cause_pg(&self, event: &Envelope, reason: &str, e: &HandlerError) {
        let Ok(tenant) = TenantId::new(event.tenant_id) else {
            return;
        };
        let error: String = e.to_string().chars().take(ERROR_CHARS).collect();
        let record = async {
            let mut tx = TenantTx::begin(&self.state.pool, tenant).await?;
            sqlx::query(
                "INSERT INTO dead_letter_causes
                     (tenant_id, consumer, source, message_id, event_type, reason, error_class, error)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                 ON CONFLICT (tenant_id, consumer, source, message_id) DO UPDATE
                 SET reason = EXCLUDED.reason, error_class = EXCLUDED.error_class,
                     error = EXCLUDED.error, dead_lettered_at = now()",
            )
            .bind(tenant.get())
            .bind(&self.config.name)
            .bind(&event.source)
            .bind(event.id)
            .bind(&event.event_type)
            .bind(reason)
            .bind(error_class(e))
            .bind(&error)
            .execute(&mut *tx)
            .await?;
            tx.commit().await
        };
        if let Err(err) = record.await {
            tracing::warn!(consumer = %self.config.name, message_id = %event.message_id(), error = %err, "could not record why it is dead-lettered");
        }
    }
}

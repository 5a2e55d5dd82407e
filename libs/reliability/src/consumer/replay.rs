//! Replaying the sources' event history through a consumer: how a derived
//! state is rebuilt (docs/adr/0006, 0030).

use sqlx::PgPool;

use crate::outbox;
use crate::{Error, Result};

use super::{Apply, Consumer, Outcome};

/// What a replay did with one source's history.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Replayed {
    pub source: String,
    /// Events read from its history.
    pub events: usize,
    /// Of those, the ones this consumer had not applied before.
    pub applied: usize,
}

/// Events read per page of a source's history.
const PAGE: i64 = 1000;

impl<A: Apply> Consumer<A> {
    /// Applies every event of each source's history (its outbox and
    /// archive, in id order; `sources` are each service's name and a pool
    /// on its database as its owner role, the only one that reads the
    /// archive), as a rebuild does: what this consumer applied already is
    /// a duplicate, so a live consumer of the same name may run beside it.
    /// Returns what each source's replay did; logs each page.
    pub async fn replay(&self, sources: &[(String, PgPool)]) -> Result<Vec<Replayed>> {
        self.replay_between(sources, |_| (0, i64::MAX)).await
    }

    /// As [`Self::replay`], the events of each source with outbox ids in
    /// `(after, upto]` = `range(source)`: the tail of a history whose start
    /// is already in the derived state (a re-projection from the sources'
    /// rows), up to where it stood when the pass began.
    pub async fn replay_between(
        &self,
        sources: &[(String, PgPool)],
        range: impl Fn(&str) -> (i64, i64),
    ) -> Result<Vec<Replayed>> {
        let mut replayed = Vec::with_capacity(sources.len());
        for (source, pool) in sources {
            let (mut after, upto) = range(source);
            let (mut count, mut applied) = (0, 0);
            'pages: loop {
                let page = outbox::history(pool, source, after, PAGE).await?;
                let Some(last) = page.last() else { break };
                after = last.id;
                for event in &page {
                    if event.id > upto {
                        break 'pages;
                    }
                    let outcome = self.apply(event).await.map_err(|e| Error::Replay {
                        message_id: event.message_id(),
                        source: Box::new(e),
                    })?;
                    applied += usize::from(outcome == Outcome::Applied);
                    count += 1;
                }
                tracing::info!(consumer = %self.config.name, source = %source, replayed = count, "replay progress");
            }
            replayed.push(Replayed {
                source: source.clone(),
                events: count,
                applied,
            });
        }
        Ok(replayed)
    }
}

//! The broker's true limit on this machine: a sliding-window confirmed
//! publisher, the relay's competitor in the same run.

use super::*;

/// Unconfirmed messages a sliding-window publisher allows.
pub(super) const WINDOW: usize = 1000;

/// The best of a publisher's runs: its rate, and the CPU it and the broker
/// spent per 1k messages in that run.
#[derive(Default)]
pub(super) struct Publish {
    pub(super) rate: f64,
    pub(super) client_ms: f64,
    pub(super) broker_ms: f64,
}

impl Publish {
    pub(super) async fn keep(
        &mut self,
        n: f64,
        run: impl std::future::Future<Output = anyhow::Result<()>>,
    ) -> anyhow::Result<()> {
        let (client, broker, t0) = (cpu_self(), crate::cost::broker_cpu(), Instant::now());
        run.await?;
        let rate = n / t0.elapsed().as_secs_f64();
        if rate > self.rate {
            *self = Self {
                rate,
                client_ms: (cpu_self() - client) * 1e6 / n,
                broker_ms: (crate::cost::broker_cpu() - broker) * 1e6 / n,
            };
        }
        Ok(())
    }
}

/// Publishes `messages` as fast as the broker confirms them: at most
/// `WINDOW` unconfirmed at any time, each confirm awaited in order, no
/// barrier between batches. Fails on any return or nack.
/// `e` as a relay publishes it, with `headers`.
pub(crate) fn outgoing(e: &Envelope, headers: FieldTable) -> anyhow::Result<Outgoing> {
    Ok(Outgoing {
        routing_key: e.routing_key(),
        message_id: e.message_id(),
        kind: e.event_type.clone(),
        headers,
        body: serde_json::to_vec(e)?,
    })
}

pub(crate) async fn sliding_window_publish(
    channel: &lapin::Channel,
    exchange: &str,
    messages: &[Outgoing],
) -> anyhow::Result<()> {
    let mut in_flight = std::collections::VecDeque::with_capacity(WINDOW);
    for m in messages {
        if in_flight.len() == WINDOW {
            let confirm: lapin::PublisherConfirm = in_flight.pop_front().expect("window is full");
            anyhow::ensure!(
                matches!(confirm.await?, lapin::Confirmation::Ack(None)),
                "not routed"
            );
        }
        let props = lapin::BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_message_id(m.message_id.as_str().into())
            .with_type(m.kind.as_str().into())
            .with_headers(m.headers.clone());
        let confirm = channel
            .basic_publish(
                exchange.into(),
                m.routing_key.as_str().into(),
                lapin::options::BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &m.body,
                props,
            )
            .await?;
        in_flight.push_back(confirm);
    }
    for confirm in in_flight {
        anyhow::ensure!(
            matches!(confirm.await?, lapin::Confirmation::Ack(None)),
            "not routed"
        );
    }
    Ok(())
}

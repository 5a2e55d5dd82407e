//! Where a failed scenario's missing work waits, if in the broker: ready in
//! a queue, held unacked by a live channel, held unacked by none (a
//! queue's unacked beyond what its channels hold: deliveries checked out
//! to a consumer that is gone), or never routed (a binding gone). Printed
//! whole, and as one `   broker:` line that CI's failure summary repeats
//! at the end of its log (`.ci/run`, `failures`).

use crate::run::Run;

/// The three listings, printed whole, then the one-line summary.
pub(crate) async fn print(run: &Run) {
    let mut listed = Vec::new();
    for (what, args) in [
        (
            "queues (name ready unacked consumers leader)",
            &[
                "list_queues",
                "name",
                "messages_ready",
                "messages_unacknowledged",
                "consumers",
                "leader",
            ][..],
        ),
        (
            "channels (name unacked)",
            &["list_channels", "name", "messages_unacknowledged"][..],
        ),
        (
            "bindings (source destination key)",
            &[
                "list_bindings",
                "source_name",
                "destination_name",
                "routing_key",
            ][..],
        ),
    ] {
        match run.world.ctl(0, args).await {
            Ok(out) => {
                println!("   {what}:\n{out}");
                listed.push(out);
            }
            Err(e) => {
                println!("   {what}: not listed ({e:#})");
                listed.push(String::new());
            }
        }
    }
    println!("   broker: {}", summary(&listed[0], &listed[1]));
}

/// The queues holding anything, and how many unacked deliveries no live
/// channel holds.
fn summary(queues: &str, channels: &str) -> String {
    let mut holding = Vec::new();
    let mut queue_unacked = 0u64;
    for row in rows(queues, 5) {
        let (ready, unacked) = (number(row[1]), number(row[2]));
        queue_unacked += unacked;
        if ready + unacked > 0 {
            holding.push(format!(
                "{} ready {ready} unacked {unacked} consumers {}",
                row[0], row[3]
            ));
        }
    }
    let channel_unacked: u64 = rows(channels, 2).map(|row| number(row[1])).sum();
    let orphaned = queue_unacked.saturating_sub(channel_unacked);
    if holding.is_empty() {
        holding.push("every queue empty".into());
    }
    format!(
        "{}; unacked in queues {queue_unacked}, held by live channels {channel_unacked}, by none {orphaned}",
        holding.join(", ")
    )
}

/// The tab-separated rows of `width` fields of a `rabbitmqctl list_*`
/// output, its header lines skipped.
fn rows(out: &str, width: usize) -> impl Iterator<Item = Vec<&str>> {
    out.lines()
        .map(|l| l.split('\t').collect::<Vec<_>>())
        .filter(move |f| f.len() == width && f[1].parse::<u64>().is_ok())
}

fn number(field: &str) -> u64 {
    field.trim().parse().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::summary;

    #[test]
    fn unacked_that_no_channel_holds_is_named() {
        let queues = "Timeout: 60.0 seconds ...\nListing queues for vhost / ...\n\
                      name\tmessages_ready\tmessages_unacknowledged\tconsumers\tleader\n\
                      e2e.graph.edges\t0\t7\t2\trabbit-1@h\n\
                      e2e.inventory.stock\t0\t0\t2\trabbit-2@h\n\
                      e2e.projection.views\t3\t1\t2\trabbit-3@h\n";
        let channels = "name\tmessages_unacknowledged\n127.0.0.1:5 -> 127.0.0.1:25401 (1)\t1\n";
        assert_eq!(
            summary(queues, channels),
            "e2e.graph.edges ready 0 unacked 7 consumers 2, e2e.projection.views ready 3 unacked 1 consumers 2; \
             unacked in queues 8, held by live channels 1, by none 7"
        );
    }
}

//! The store's restart is bounded and loses nothing: `scripts/falkordb.sh`
//! has FalkorDB rewrite its append-only log once it passes a size and grows
//! by a quarter, with a snapshot as its preamble, so a restart loads the
//! snapshot and replays at most a quarter of it as statements; and every
//! write the consumer was answered for is there after a kill -9 (ADR 0030,
//! amended in session 32). How many seconds that takes is a benchmark's
//! figure, not this test's: `scripts/falkordb_restart.py`.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use graph::store::{Cypher, Params, Store};
use reliability::TenantId;
use reliability::consumer::{ConsumerConfig, Outcome};
use testkit::unique;

use super::{CONSUMER, consumer, line, placed};

/// A FalkorDB of this test's own, started by the script the stack uses,
/// with its first rewrite at `aof_min` instead of 4 MB.
struct Scratch {
    port: u16,
    dir: PathBuf,
    aof_min: &'static str,
}

impl Scratch {
    fn script(&self, action: &str) -> String {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/falkordb.sh");
        let out = Command::new("bash")
            .args([script, action])
            .env("FALKORDB_PORT", self.port.to_string())
            .env("FALKORDB_DIR", &self.dir)
            .env("FALKORDB_AOF_REWRITE_MIN_SIZE", self.aof_min)
            .output()
            .expect("run scripts/falkordb.sh");
        assert!(
            out.status.success(),
            "scripts/falkordb.sh {action}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// kill -9, as a crash: nothing flushed on the way out.
    async fn kill9(&self) {
        let pid = std::fs::read_to_string(self.dir.join("falkordb.pid")).expect("its pid file");
        let killed = Command::new("kill")
            .args(["-9", pid.trim()])
            .status()
            .expect("kill");
        assert!(killed.success());
        let proc = PathBuf::from(format!("/proc/{}", pid.trim()));
        testkit::wait_until(std::time::Duration::from_secs(10), "FalkorDB gone", || {
            let gone = !proc.exists();
            async move { gone }
        })
        .await;
    }

    async fn persistence(&self) -> (i64, i64, i64) {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", self.port)).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let info: String = redis::cmd("INFO")
            .arg("persistence")
            .query_async(&mut conn)
            .await
            .unwrap();
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(&format!("{name}:")))
                .and_then(|v| v.trim().parse::<i64>().ok())
                .unwrap_or_else(|| panic!("INFO persistence has {name}: {info}"))
        };
        (
            field("aof_rewrites"),
            field("aof_base_size"),
            field("aof_current_size"),
        )
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        self.script("stop");
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What the graph holds of tenant 1: orders with their total, CONTAINS
/// edges, and units ordered over every product.
async fn held(store: &Store) -> (i64, i64, i64) {
    const HELD: Cypher = Cypher(
        "MATCH (o:Order {tenant: $tenant}) WHERE o.total_cents = 1000 \
         OPTIONAL MATCH (o)-[r:CONTAINS]->(:Product {tenant: $tenant}) \
         WITH count(DISTINCT o) AS orders, count(r) AS edges \
         MATCH (p:Product {tenant: $tenant}) \
         RETURN orders, edges, toInteger(sum(p.units_ordered)) AS units",
    );
    let rows = store
        .run(TenantId::new(1).unwrap(), HELD, Params::new())
        .await
        .unwrap();
    let n = |c: &str| rows[0][c].as_i64().unwrap_or(-1);
    (n("orders"), n("edges"), n("units"))
}

#[tokio::test]
async fn a_restart_replays_a_bounded_log_and_loses_no_answered_write() {
    const ORDERS: i64 = 600;
    // A port nothing listens on now (the server binds it a moment later).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let scratch = Scratch {
        port,
        dir: std::env::temp_dir().join(unique("graphtest-restart-")),
        aof_min: "128kb",
    };
    scratch.script("start");
    let url = format!("falkor://127.0.0.1:{port}");
    let store = Arc::new(Store::new(&url, "restart"));
    let edges = consumer(&store, ConsumerConfig::new(CONSUMER, "", &[]));
    for order in 1..=ORDERS {
        let event = placed(
            order,
            1,
            order,
            "c1",
            serde_json::json!([line("A", 1), line("B", 2)]),
        );
        assert_eq!(edges.apply(&event).await.unwrap(), Outcome::Applied);
    }
    let answered = held(&store).await;
    assert_eq!(answered, (ORDERS, 2 * ORDERS, 3 * ORDERS));
    let (rewrites, base, current) = scratch.persistence().await;
    // Rewritten along the way, so what a restart replays as statements is
    // at most a quarter of the snapshot, or the first threshold.
    assert!(rewrites >= 1, "no rewrite in {current} bytes of log");
    assert!(
        current - base <= (base / 4).max(128 * 1024) + 64 * 1024,
        "the log's tail past its snapshot: {} bytes of {current}",
        current - base
    );

    scratch.kill9().await;
    scratch.script("start");
    let again = Arc::new(Store::new(&url, "restart"));
    assert_eq!(held(&again).await, answered, "what was answered is there");
    let edges = consumer(&again, ConsumerConfig::new(CONSUMER, "", &[]));
    let redelivered = placed(ORDERS, 1, ORDERS, "c1", serde_json::json!([line("A", 1)]));
    assert_eq!(
        edges.apply(&redelivered).await.unwrap(),
        Outcome::Duplicate,
        "its checkpoints came back with it"
    );
}

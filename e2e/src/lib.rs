//! The whole system in one process, for tests that follow an order across
//! every service: the five services (all roles) and the provider simulator,
//! each service on a database of its own, all on one exchange of their own
//! on the real broker.

pub mod check;
pub mod client;
pub mod cluster;
mod command;
pub mod hosts;
pub mod pooler;
pub mod procs;
pub mod untouched;
pub mod verified;
pub mod world;

use std::time::Duration;

use serde_json::{Value, json};
use service_kit::service::{self, CommonSettings, Settings, ShutdownToken};
use testkit::{ApiClient, TestDb, unique, wait_until};

pub struct Stack {
    pub orders: ApiClient,
    pub inventory: ApiClient,
    pub payments: ApiClient,
    pub projection: ApiClient,
    pub graph: ApiClient,
    pub psp: psp_sim::Simulator,
    /// Where the simulator listens.
    pub psp_url: String,
    pub dbs: Dbs,
    pub common: CommonSettings,
    /// Each service's ops port (`/readyz`, `/metrics`): all of its roles.
    pub ops_ports: Vec<(&'static str, u16)>,
    stop: ShutdownToken,
}

pub struct Dbs {
    pub orders: TestDb,
    pub inventory: TestDb,
    pub payments: TestDb,
    pub projection: TestDb,
    pub graph: TestDb,
}

impl Stack {
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(|_| {}).await
    }

    /// As [`start`](Self::start), with `settings` changing what all four
    /// services share (e.g. where they export spans).
    pub async fn start_with(settings: impl FnOnce(&mut CommonSettings)) -> anyhow::Result<Self> {
        let stop = ShutdownToken::new();
        let mut common = testkit::common_settings();
        common.exchange = unique("reltest.stack.");
        common.queue_prefix = format!("{}.", common.exchange);
        settings(&mut common);
        let jwt = common.jwt_keys();
        let dbs = Dbs {
            orders: TestDb::with_migrations(&orders::MIGRATIONS).await,
            inventory: TestDb::with_migrations(&inventory::MIGRATIONS).await,
            payments: TestDb::with_migrations(&payments::MIGRATIONS).await,
            projection: TestDb::with_migrations(&projection::MIGRATIONS).await,
            graph: TestDb::with_migrations(&graph::MIGRATIONS).await,
        };

        let sim = psp_sim::Application::build(psp_sim::Settings::local(0)).await?;
        let (psp_url, psp) = (format!("http://127.0.0.1:{}", sim.port()), sim.simulator());
        tokio::spawn(sim.run_until_stopped(stop.clone()));

        let o = service::start(
            &orders::SERVICE,
            Settings::local(common.clone()),
            dbs.orders.databases(),
            stop.clone(),
        )
        .await?;
        let i = service::start(
            &inventory::SERVICE,
            Settings::local(common.clone()),
            dbs.inventory.databases(),
            stop.clone(),
        )
        .await?;
        let psp_settings = payments::PspSettings {
            psp_url: psp_url.clone(),
            psp_timeout_ms: 1000,
            psp_lease_secs: 5,
            ..Default::default()
        };
        let p = service::start(
            &payments::SERVICE,
            Settings {
                service: psp_settings,
                ..Settings::local(common.clone())
            },
            dbs.payments.databases(),
            stop.clone(),
        )
        .await?;
        let v = service::start(
            &projection::SERVICE,
            Settings::local(common.clone()),
            dbs.projection.databases(),
            stop.clone(),
        )
        .await?;
        let g = service::start(
            &graph::SERVICE,
            Settings {
                service: graph::GraphSettings {
                    graph_url: graph::test_url(),
                    graph_name: common.exchange.clone(),
                    ..graph::GraphSettings::default()
                },
                ..Settings::local(common.clone())
            },
            dbs.graph.databases(),
            stop.clone(),
        )
        .await?;
        let ops_ports = vec![
            (orders::SERVICE.name, o.ops_port()),
            (inventory::SERVICE.name, i.ops_port()),
            (payments::SERVICE.name, p.ops_port()),
            (projection::SERVICE.name, v.ops_port()),
            (graph::SERVICE.name, g.ops_port()),
        ];
        let stack = Self {
            orders: ApiClient::new(o.port(), jwt.clone()),
            inventory: ApiClient::new(i.port(), jwt.clone()),
            payments: ApiClient::new(p.port(), jwt.clone()),
            projection: ApiClient::new(v.port(), jwt.clone()),
            graph: ApiClient::new(g.port(), jwt),
            psp,
            psp_url,
            dbs,
            common,
            ops_ports,
            stop,
        };
        tokio::spawn(o.run_until_stopped());
        tokio::spawn(i.run_until_stopped());
        tokio::spawn(p.run_until_stopped());
        tokio::spawn(v.run_until_stopped());
        tokio::spawn(g.run_until_stopped());
        stack.wait_until_consuming().await;
        Ok(stack)
    }

    /// Every consumer has declared and bound its queue (so no event is
    /// published before a queue can take it).
    async fn wait_until_consuming(&self) {
        let queues = cluster::queues(&self.common.queue_prefix);
        testkit::wait_for_queues(&queues).await;
    }

    pub async fn stock(&self, tenant: i64, sku: &str, units: i64) {
        let body = json!({"sku": sku, "delta": units, "reason": "restock"}).to_string();
        let (status, _, body) = self
            .inventory
            .post(tenant, "/stock/adjustments", &unique("adj-"), &body)
            .await;
        assert_eq!(status, 201, "{body}");
    }

    /// Places an order of `quantity` × `sku` at 1250 each; returns its id.
    pub async fn order(&self, tenant: i64, customer: &str, sku: &str, quantity: i64) -> i64 {
        let body = json!({"customer_id": customer, "currency": "EUR",
                          "lines": [{"sku": sku, "quantity": quantity, "unit_price_cents": 1250}]})
        .to_string();
        let (status, _, body) = self
            .orders
            .post(tenant, "/orders", &unique("order-"), &body)
            .await;
        assert_eq!(status, 201, "{body}");
        body["order_id"].as_i64().expect("order id")
    }

    /// Waits until the order is confirmed or cancelled in orders AND the
    /// projection agrees; returns the projection's view.
    pub async fn settled(&self, tenant: i64, order_id: i64) -> Value {
        let path = format!("/orders/{order_id}");
        wait_until(
            Duration::from_secs(30),
            &format!("order {order_id} settled everywhere"),
            || async {
                let (_, order) = self.orders.get(tenant, &path).await;
                let (_, view) = self.projection.get(tenant, &path).await;
                let done = |s: &Value| s == "confirmed" || s == "cancelled";
                // The projection applies each source's events in any order
                // (ADR 0002): the order's status can arrive before the
                // inventory or payment event it also shows. Settled is when
                // the view has heard from every source.
                let (reservation, payment) = (&view["reservation_status"], &view["payment_status"]);
                let heard_all = match reservation.as_str() {
                    Some("committed") => payment == "captured",
                    Some("released") => payment == "failed",
                    Some("rejected") => true,
                    _ => false,
                };
                done(&order["status"]) && view["status"] == order["status"] && heard_all
            },
        )
        .await;
        self.projection.get(tenant, &path).await.1
    }

    /// Stocks ten of `sku`, has twenty customers order one each at once,
    /// and waits until every order is settled everywhere; the orders' ids
    /// and how many were confirmed.
    pub async fn race_for_ten(
        self: &std::sync::Arc<Self>,
        tenant: i64,
        sku: &str,
    ) -> (Vec<i64>, usize) {
        self.stock(tenant, sku, 10).await;
        let ids = futures_util::future::join_all((0..20).map(|i| {
            let stack = self.clone();
            async move { stack.order(tenant, &format!("c-{i}"), sku, 1).await }
        }))
        .await;
        let mut confirmed = 0;
        for id in &ids {
            if self.settled(tenant, *id).await["status"] == "confirmed" {
                confirmed += 1;
            }
        }
        (ids, confirmed)
    }

    pub async fn stop(self) {
        self.stop.cancel();
        let queues = cluster::queue_names(&self.common.queue_prefix);
        testkit::delete_broker_objects(&queues, &self.common.exchange).await;
        let graph = graph::store::Store::new(&graph::test_url(), &self.common.exchange);
        if let Err(e) = graph.delete().await {
            eprintln!("the stack's graph stays behind: {e}");
        }
        for db in [
            self.dbs.orders,
            self.dbs.inventory,
            self.dbs.payments,
            self.dbs.projection,
            self.dbs.graph,
        ] {
            db.cleanup().await;
        }
    }
}

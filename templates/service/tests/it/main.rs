//! __SERVICE__ against the real PostgreSQL and RabbitMQ.

use std::sync::Arc;
use std::time::Duration;

use __SERVICE__::Settings;
use service_kit::service::{Role, ShutdownToken};
use testkit::{ApiClient, TestDb, unique, wait_until};

struct TestApp {
    api: ApiClient,
    db: TestDb,
    stop: ShutdownToken,
    /// The consumer's queues: its queue, or its partitions and its name.
    queues: Vec<String>,
    exchange: String,
}

impl TestApp {
    /// The whole service (HTTP, relay, consumer) on a database and exchange of its own.
    async fn spawn() -> Self {
        let db = TestDb::with_migrations(&__SERVICE__::MIGRATIONS).await;
        let mut common = testkit::common_settings();
        common.exchange = unique("reltest.__SERVICE__.");
        common.queue_prefix = format!("{}.", common.exchange);
        let common_prefix = common.queue_prefix.clone();
        let exchange = common.exchange.clone();
        let settings = Settings {
            role: Role::All,
            ..Settings::local(common)
        };
        let app = testkit::serve(&__SERVICE__::SERVICE, settings, db.databases()).await;
        let spec = reliability::broker::QueueSpec::for_subscription(
            &__SERVICE__::audit::SUBSCRIPTION,
            &exchange,
            &common_prefix,
        );
        testkit::wait_for_queues(&spec.queues()).await;
        let mut queues = spec.queues();
        if spec.is_ordered() {
            queues.push(spec.queue.clone());
        }
        Self {
            api: app.api,
            db,
            stop: app.stop,
            queues,
            exchange,
        }
    }

    async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.db.owner)
            .await
            .unwrap()
    }

    async fn stop(self) {
        self.stop.cancel();
        testkit::delete_broker_objects(&self.queues, &self.exchange).await;
        self.db.cleanup().await;
    }
}

#[tokio::test]
async fn an_item_is_created_once_per_key_and_audited_once() {
    let app = Arc::new(TestApp::spawn().await);
    let answers = futures_util::future::join_all((0..10).map(|_| {
        let app = app.clone();
        async move {
            app.api
                .post(1, "/items", "item-key", r#"{"name": "first"}"#)
                .await
        }
    }))
    .await;
    assert!(
        answers
            .iter()
            .all(|(status, _, _)| *status == 201 || *status == 425),
        "{answers:?}"
    );
    assert_eq!(app.count("SELECT count(*) FROM items").await, 1);
    let item_id = answers.iter().find(|a| a.0 == 201).unwrap().2["item_id"].clone();

    let (status, item) = app.api.get(1, &format!("/items/{item_id}")).await;
    assert_eq!((status, item["name"].as_str()), (200, Some("first")));
    let (status, _) = app.api.get(2, &format!("/items/{item_id}")).await;
    assert_eq!(status, 404, "another tenant cannot see it");

    // The relay publishes ItemCreated; the consumer records it once.
    wait_until(Duration::from_secs(20), "item audited", || async {
        app.count("SELECT count(*) FROM item_audit").await == 1
    })
    .await;
    Arc::into_inner(app).unwrap().stop().await;
}

#[tokio::test]
async fn an_invalid_item_gets_422_and_writes_nothing() {
    let app = TestApp::spawn().await;
    let (status, _, err) = app.api.post(1, "/items", "bad", r#"{"name": ""}"#).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (422, Some("invalid_item"))
    );
    let (status, _, _) = app.api.post(1, "/items", "bad2", r#"{"name": 7}"#).await;
    assert_eq!(status, 422);
    // PostgreSQL text refuses NUL: a rule, not a 500.
    let (status, _, _) = app
        .api
        .post(1, "/items", "bad3", r#"{"name": "a\u0000b"}"#)
        .await;
    assert_eq!(status, 422);
    assert_eq!(app.count("SELECT count(*) FROM items").await, 0);
    app.stop().await;
}

/// The handler under competing appliers (docs/adr/0010): three consumers,
/// shuffled and repeated delivery, the same state as one in order.
#[tokio::test]
async fn three_competing_consumers_audit_like_one_in_order() {
    use testkit::{AppliersCheck, assert_competing_appliers_agree, event};
    let created = (1..=60_i64)
        .map(|n| {
            event(
                "__SERVICE__",
                n,
                1 + n % 2,
                ("item", n),
                <__SERVICE__::http::ItemCreated as contracts::Event>::TYPE,
                serde_json::json!({"item_id": n, "name": format!("item {n}")}),
            )
        })
        .collect();
    assert_competing_appliers_agree(
        AppliersCheck {
            migrations: &__SERVICE__::MIGRATIONS,
            consumer: __SERVICE__::audit::CONSUMER,
            waves: vec![created],
            seed: "",
            state: "SELECT tenant_id, item_id FROM item_audit",
        },
        || __SERVICE__::audit::Audit,
    )
    .await;
}

//! What the console's tests share: a console served on a spare port, an
//! HTTP client that shows redirects, a form's body, and a consumer queue
//! whose DLQ holds letters of two causes.
#![allow(dead_code)] // each test crate uses part of it

use contracts::topology::Subscription;
use operator::console::{self, Auth, Console};
use operator::ops;
use reliability::broker::{self, QueueSpec};
use testkit::{Broker, TestDb, unique};

pub static SUBSCRIPTIONS: &[Subscription] = &[Subscription::new("shop.views", &["svc.A", "svc.B"])];

/// Serves a console over `estate` on a spare port; returns its URL.
pub async fn serve(
    estate: ops::Estate,
    auth: Auth,
    read_only: bool,
    roles: Vec<ops::roles::RoleProbe>,
) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let console = Console {
        estate,
        auth,
        read_only,
        // Nothing listens there: the order page says so and goes on.
        psp_url: "http://127.0.0.1:9".into(),
        roles,
        samples: Default::default(),
        limits: service_kit::admission::AdmissionLimits::parse(1000, "", Default::default())
            .unwrap(),
    };
    tokio::spawn(console::serve(listener, console));
    url
}

/// A client that returns redirects instead of following them.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// The page at `url`, as a client without a session reads it.
pub async fn page(url: impl reqwest::IntoUrl) -> String {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// A form's body, as a browser encodes it (reqwest's `form` is a
/// feature the workspace does not build).
pub fn form<K: AsRef<str>, V: AsRef<str>>(pairs: &[(K, V)]) -> String {
    let enc = |s: &str| {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    pairs
        .iter()
        .map(|(k, v)| format!("{}={}", enc(k.as_ref()), enc(v.as_ref())))
        .collect::<Vec<_>>()
        .join("&")
}

/// A request's body as a browser's form post.
pub trait FormBody {
    fn form<K: AsRef<str>, V: AsRef<str>>(self, pairs: &[(K, V)]) -> Self;
}

impl FormBody for reqwest::RequestBuilder {
    fn form<K: AsRef<str>, V: AsRef<str>>(self, pairs: &[(K, V)]) -> Self {
        self.header("content-type", "application/x-www-form-urlencoded")
            .body(form(pairs))
    }
}

/// `shop.views`' queue, its DLQ holding svc:1 and svc:2 (one cause, told
/// apart by a number, recorded in `db`) and svc:3 (none recorded).
pub struct Letters {
    pub broker: Broker,
    pub spec: QueueSpec,
    pub dlq: String,
    pub prefix: String,
}

pub async fn letters(db: &TestDb) -> Letters {
    let broker = Broker::new().await;
    let prefix = unique("reltest.console.");
    let spec = QueueSpec::for_subscription(&SUBSCRIPTIONS[0], &broker.exchange, &prefix);
    broker::declare_queue(&broker.channel, &spec).await.unwrap();
    let letters = [("svc:1", "A"), ("svc:2", "A"), ("svc:3", "B")];
    let dlq = broker.dead_letters(&spec.queue, &letters).await;
    sqlx::raw_sql(
        "INSERT INTO dead_letter_causes (tenant_id, consumer, source, message_id, event_type, reason,
                                         error_class, error)
         VALUES (1, 'shop.views', 'svc', 1, 'A', 'handler_failed', 'permanent', 'permanent: no order 7'),
                (2, 'shop.views', 'svc', 2, 'A', 'handler_failed', 'permanent', 'permanent: no order 9')",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    Letters {
        broker,
        spec,
        dlq,
        prefix,
    }
}

impl Letters {
    /// An estate of `databases` and this broker's `shop.views`.
    pub async fn estate(&self, databases: Vec<(String, sqlx::PgPool)>) -> ops::Estate {
        ops::Estate {
            databases,
            broker: Some(
                broker::connect(&testkit::amqp_url(), "console-test")
                    .await
                    .unwrap(),
            ),
            queue_prefix: self.prefix.clone(),
            exchange: self.broker.exchange.clone(),
            subscriptions: SUBSCRIPTIONS,
            ordered_partitions: String::new(),
            management_url: None,
        }
    }
}

//! The console's dead letters, against a real RabbitMQ and PostgreSQL:
//! grouped by the handler's error their consumer recorded, a group
//! re-driven once, the others kept (issue 45).

use contracts::topology::Subscription;
use operator::console::{self, Auth, Console};
use operator::ops;
use reliability::broker::{self, QueueSpec};
use reqwest::StatusCode;
use testkit::{Broker, DEADLINE, TestDb, amqp_url, unique, wait_until};

static SUBSCRIPTIONS: &[Subscription] = &[Subscription::new("shop.views", &["svc.A", "svc.B"])];

#[tokio::test]
async fn dead_letters_are_grouped_by_their_recorded_cause_and_a_group_is_re_driven_once() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let prefix = unique("reltest.console.");
    let spec = QueueSpec::for_subscription(&SUBSCRIPTIONS[0], &broker.exchange, &prefix);
    broker::declare_queue(&broker.channel, &spec).await.unwrap();
    let dlq = broker
        .dead_letters(
            &spec.queue,
            &[("svc:1", "A"), ("svc:2", "A"), ("svc:3", "B")],
        )
        .await;
    // Two letters of one cause (the numbers differ), one with none recorded.
    sqlx::raw_sql(
        "INSERT INTO dead_letter_causes (tenant_id, consumer, source, message_id, event_type, reason,
                                         error_class, error)
         VALUES (1, 'shop.views', 'svc', 1, 'A', 'handler_failed', 'permanent', 'permanent: no order 7'),
                (2, 'shop.views', 'svc', 2, 'A', 'handler_failed', 'permanent', 'permanent: no order 9')",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    let estate = ops::Estate {
        databases: vec![("shop".into(), db.owner.clone())],
        broker: Some(broker::connect(&amqp_url(), "console-test").await.unwrap()),
        queue_prefix: prefix,
        exchange: broker.exchange.clone(),
        subscriptions: SUBSCRIPTIONS,
        ordered_partitions: String::new(),
        management_url: None,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let auth = Auth::none();
    let csrf = auth.csrf();
    let console = Console {
        estate,
        auth,
        read_only: false,
        psp_url: "http://127.0.0.1:9".into(),
        roles: Vec::new(),
        limits: service_kit::admission::AdmissionLimits::parse(1000, "", Default::default())
            .unwrap(),
    };
    tokio::spawn(console::serve(listener, console));
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();

    let page = http
        .get(format!("{url}/dead-letters"))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    let page = page.text().await.unwrap();
    assert!(
        page.contains("<strong>permanent</strong>: permanent: no order #"),
        "{page}"
    );
    assert!(
        page.contains("Re-drive these 2") && page.contains("<strong>not recorded</strong>: "),
        "{page}"
    );
    wait_until(DEADLINE, "peeked letters back in the DLQ", || async {
        broker.depth(&dlq).await == 3
    })
    .await;

    let redrive = || {
        http.post(format!("{url}/dead-letters/redrive"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!(
                "consumer=shop.views&ids=svc%3A1%2Csvc%3A2&csrf={csrf}"
            ))
            .send()
    };
    let first = redrive().await.unwrap();
    assert_eq!(first.status(), StatusCode::SEE_OTHER);
    wait_until(
        DEADLINE,
        "the group on the queue, the other letter kept",
        || async { broker.depth(&spec.queue).await == 2 && broker.depth(&dlq).await == 1 },
    )
    .await;
    let again = redrive().await.unwrap();
    assert_eq!(again.status(), StatusCode::CONFLICT);
    assert!(again.text().await.unwrap().contains("nothing moved"));
    assert_eq!(
        broker.depth(&spec.queue).await,
        2,
        "nothing re-driven twice"
    );
    broker.cleanup(&[&spec.queue]).await;
    db.cleanup().await;
}

//! The console's dead letters, against a real RabbitMQ and PostgreSQL:
//! grouped by the handler's error their consumer recorded, a group
//! re-driven once, the others kept (issue 45).

use operator::console::Auth;
use reqwest::StatusCode;
use support::FormBody;
use testkit::{DEADLINE, TestDb, wait_until};

mod support;

#[tokio::test]
async fn dead_letters_are_grouped_by_cause_a_group_re_driven_once_and_one_dropped_as_shown() {
    let db = TestDb::new().await;
    let letters = support::letters(&db).await;
    let (broker, queue, dlq) = (&letters.broker, &letters.spec.queue, &letters.dlq);
    let estate = letters
        .estate(vec![("shop".into(), db.owner.clone())])
        .await;
    let auth = Auth::none();
    let csrf = auth.csrf();
    let url = support::serve(estate, auth, false, Vec::new()).await;
    let http = support::client();

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
        broker.depth(dlq).await == 3
    })
    .await;

    let redrive = || {
        http.post(format!("{url}/dead-letters/redrive"))
            .form(&[
                ("consumer", "shop.views"),
                ("ids", "svc:1,svc:2"),
                ("csrf", &csrf),
            ])
            .send()
    };
    let first = redrive().await.unwrap();
    assert_eq!(first.status(), StatusCode::SEE_OTHER);
    wait_until(
        DEADLINE,
        "the group on the queue, the other letter kept",
        || async { broker.depth(queue).await == 2 && broker.depth(dlq).await == 1 },
    )
    .await;
    let again = redrive().await.unwrap();
    assert_eq!(again.status(), StatusCode::CONFLICT);
    assert!(again.text().await.unwrap().contains("nothing moved"));
    assert_eq!(broker.depth(queue).await, 2, "nothing re-driven twice");

    // The letter left over, dropped after a page that shows it; once.
    let ask = http
        .get(format!(
            "{url}/dead-letters/drop?consumer=shop.views&id=svc%3A3"
        ))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(ask.contains("Drop svc:3 for good"), "{ask}");
    let drop = || {
        http.post(format!("{url}/dead-letters/drop"))
            .form(&[("consumer", "shop.views"), ("id", "svc:3"), ("csrf", &csrf)])
            .send()
    };
    assert_eq!(drop().await.unwrap().status(), StatusCode::SEE_OTHER);
    wait_until(DEADLINE, "the DLQ empty", || async {
        broker.depth(dlq).await == 0
    })
    .await;
    assert_eq!(drop().await.unwrap().status(), StatusCode::CONFLICT);
    assert_eq!(
        broker.depth(queue).await,
        2,
        "a dropped letter is not re-driven"
    );
    let queue = queue.clone();
    letters.broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

//! What the operator's tests over a whole stack share.

use e2e::Stack;
use operator::ops;

/// The stack's services as `reliability status` and the console see them.
pub async fn estate(stack: &Stack) -> ops::Estate {
    ops::Estate {
        databases: vec![
            ("orders".into(), stack.dbs.orders.owner.clone()),
            ("inventory".into(), stack.dbs.inventory.owner.clone()),
            ("payments".into(), stack.dbs.payments.owner.clone()),
            ("projection".into(), stack.dbs.projection.owner.clone()),
        ],
        broker: Some(
            reliability::broker::connect(&stack.common.amqp_url, "operator-test")
                .await
                .unwrap(),
        ),
        queue_prefix: stack.common.queue_prefix.clone(),
        exchange: stack.common.exchange.clone(),
        subscriptions: contracts::topology::ALL,
        ordered_partitions: String::new(),
        management_url: None,
    }
}

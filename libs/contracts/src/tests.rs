use super::*;

#[test]
fn every_binding_names_a_source_and_a_known_event_or_all_of_them() {
    let sources = [source::ORDERS, source::INVENTORY, source::PAYMENTS];
    let events = [
        event::ORDER_PLACED,
        event::ORDER_CONFIRMED,
        event::ORDER_CANCELLED,
        event::INVENTORY_RESERVED,
        event::INVENTORY_REJECTED,
        event::STOCK_ADJUSTED,
        event::PAYMENT_CAPTURED,
        event::PAYMENT_FAILED,
        event::REFUND_ISSUED,
    ];
    for sub in topology::ALL {
        for binding in sub.bindings {
            let (source, event) = binding.split_once('.').expect("<source>.<event>");
            assert!(sources.contains(&source), "{binding}");
            assert!(event == "*" || events.contains(&event), "{binding}");
        }
    }
}

#[test]
fn every_event_name_has_a_payload_type_and_a_version() {
    assert_eq!(OrderPlaced::TYPE, "OrderPlaced");
    assert_eq!(RefundIssued::SOURCE, source::PAYMENTS);
    let catalogue = catalogue();
    for sub in topology::ALL {
        for binding in sub.bindings {
            let (_, name) = binding.split_once('.').unwrap();
            assert!(
                name == "*" || catalogue.iter().any(|c| c.name == name && c.version == 1),
                "{binding}"
            );
        }
    }
}

#[test]
fn any_event_decodes_each_type_by_its_name_and_refuses_the_rest() {
    let payload = serde_json::json!({"order_id": 7, "reason": "too late"});
    assert_eq!(
        AnyEvent::decode(event::ORDER_CANCELLED, 1, &payload).unwrap(),
        AnyEvent::OrderCancelled(OrderCancelled {
            order_id: 7,
            reason: "too late".into()
        })
    );
    assert!(matches!(
        AnyEvent::decode("NoSuchEvent", 1, &payload),
        Err(DecodeError::UnknownType(_))
    ));
    assert!(matches!(
        AnyEvent::decode(event::ORDER_CANCELLED, 2, &payload),
        Err(DecodeError::UnknownVersion { version: 2, .. })
    ));
    assert!(matches!(
        AnyEvent::decode(event::ORDER_PLACED, 1, &payload),
        Err(DecodeError::Payload { .. })
    ));
}

#[test]
fn payloads_keep_their_wire_names() {
    let e = OrderCancelled {
        order_id: 7,
        reason: "payment_failed".into(),
    };
    assert_eq!(
        serde_json::to_string(&e).unwrap(),
        r#"{"order_id":7,"reason":"payment_failed"}"#
    );
}

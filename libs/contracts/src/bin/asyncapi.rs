//! `asyncapi DIR`: writes the events' AsyncAPI 3.0 document
//! (`DIR/asyncapi.json`: the exchange, one channel per routing key, who
//! sends and who receives, the envelope and its CloudEvents headers) and
//! one JSON Schema per event (`DIR/schemas/<Type>.v<version>.json`).
//! `make openapi` runs it and `scripts/check_asyncapi.py` checks it in CI.

use std::path::PathBuf;

use contracts::{EXCHANGE, catalogue, topology};
use serde_json::{Map, Value, json};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "target/asyncapi".into()),
    );
    std::fs::create_dir_all(dir.join("schemas"))?;
    let (mut channels, mut operations, mut messages) = (Map::new(), Map::new(), Map::new());
    for event in catalogue() {
        let schema = serde_json::to_value(&event.schema)?;
        let key = format!("{}.{}", event.source, event.name);
        let mut file = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": format!("urn:commerce:event:{}:v{}", event.name, event.version),
            "title": format!("{} v{}", event.name, event.version),
        });
        if let (Value::Object(f), Value::Object(s)) = (&mut file, &schema) {
            f.extend(s.clone());
        }
        let path = dir.join(format!("schemas/{}.v{}.json", event.name, event.version));
        std::fs::write(path, serde_json::to_string_pretty(&file)? + "\n")?;
        messages.insert(
            event.name.into(),
            message(event.name, event.version, event.source, schema),
        );
        channels.insert(key.clone(), json!({
            "address": key,
            "messages": {event.name: {"$ref": format!("#/components/messages/{}", event.name)}},
            "bindings": {"amqp": {"is": "routingKey", "exchange": {"name": EXCHANGE, "type": "topic", "durable": true, "autoDelete": false, "vhost": "/"}}},
        }));
        operations.insert(format!("publish{}", event.name), json!({
            "action": "send",
            "channel": {"$ref": format!("#/channels/{key}")},
            "summary": format!("{} publishes it through its outbox and relay (at least once)", event.source),
        }));
    }
    for sub in topology::ALL {
        for binding in sub.bindings {
            for key in channels
                .keys()
                .filter(|k| topology::topic_matches(binding, k))
                .cloned()
                .collect::<Vec<_>>()
            {
                operations.insert(format!("{}.{}", sub.consumer, key), json!({
                    "action": "receive",
                    "channel": {"$ref": format!("#/channels/{key}")},
                    "summary": format!("queue {} (bound to {binding}) applies it exactly once", sub.consumer),
                }));
            }
        }
    }
    let doc = json!({
        "asyncapi": "3.0.0",
        "info": {
            "title": "commerce events",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Every event on the topic exchange: routing key <source>.<Type>, body the envelope (JSON), CloudEvents 1.0 attributes as ce- headers (binary content mode).",
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages},
    });
    std::fs::write(
        dir.join("asyncapi.json"),
        serde_json::to_string_pretty(&doc)? + "\n",
    )?;
    println!(
        "{}: {} events",
        dir.join("asyncapi.json").display(),
        catalogue().len()
    );
    Ok(())
}

/// The message: the envelope around the event's payload, its AMQP
/// properties and CloudEvents headers.
fn message(name: &str, version: i32, source: &str, payload: Value) -> Value {
    let text = json!({"type": "string"});
    json!({
        "name": name,
        "contentType": "application/json",
        "headers": {
            "type": "object",
            "required": ["ce-specversion", "ce-id", "ce-source", "ce-type", "ce-time"],
            "properties": {
                "ce-specversion": {"const": "1.0"},
                "ce-id": {"type": "string", "description": "<source>:<outbox id>, unique per source; the AMQP message_id"},
                "ce-source": {"const": format!("/commerce/{source}")},
                "ce-type": {"const": name},
                "ce-time": {"type": "string", "format": "date-time"},
                "ce-subject": text,
                "ce-dataversion": {"const": version.to_string()},
                "ce-tenantid": text,
                "traceparent": text,
                "x-aggregate": {"type": "string", "description": "<tenant>/<aggregate_type>:<aggregate_id>: what an ordered subscription's partition is chosen by (ADR 0028)"},
            },
        },
        "payload": {
            "type": "object",
            "required": ["id", "source", "tenant_id", "aggregate_type", "aggregate_id", "event_type", "event_version", "occurred_at", "payload"],
            "properties": {
                "id": {"type": "integer"},
                "source": {"const": source},
                "tenant_id": {"type": "integer", "minimum": 1},
                "aggregate_type": text,
                "aggregate_id": text,
                "event_type": {"const": name},
                "event_version": {"const": version},
                "occurred_at": {"type": "string", "format": "date-time"},
                "aggregate_seq": {"type": "integer", "minimum": 1, "description": "the event's number in its aggregate, given by a relay with an ordered subscriber (ADR 0028); absent otherwise"},
                "payload": payload,
            },
        },
        "bindings": {"amqp": {"messageType": name, "deliveryMode": 2}},
    })
}

"""Checks the events' AsyncAPI document and JSON Schemas (written by
`cargo run -p contracts --bin asyncapi DIR`): every schema is a valid JSON
Schema (2020-12), every message's headers and envelope are valid schemas
that accept a sample event, every reference resolves, and every routing
key a subscriber binds reaches a channel someone sends on."""
import json, pathlib, sys
from jsonschema import Draft202012Validator

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/asyncapi")
doc = json.load(open(root / "asyncapi.json"))
errors = []
if doc.get("asyncapi") != "3.0.0":
    errors.append("asyncapi: not 3.0.0")


def resolve(ref):
    node = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node.get(part) if isinstance(node, dict) else None
    if node is None:
        errors.append(f"dangling reference {ref}")
    return node


messages = doc["components"]["messages"]
for path in sorted((root / "schemas").glob("*.json")):
    schema = json.load(open(path))
    try:
        Draft202012Validator.check_schema(schema)
    except Exception as e:
        errors.append(f"{path.name}: invalid JSON Schema: {e}")
    name = path.name.split(".")[0]
    if name not in messages:
        errors.append(f"{path.name}: no message {name} in the document")
for name, msg in messages.items():
    for part in ("headers", "payload"):
        try:
            Draft202012Validator.check_schema(msg[part])
        except Exception as e:
            errors.append(f"message {name}: invalid {part} schema: {e}")
    sample_headers = {"ce-specversion": "1.0", "ce-id": "x:1", "ce-type": name,
                      "ce-source": msg["headers"]["properties"]["ce-source"]["const"],
                      "ce-time": "2026-11-23T10:00:00Z"}
    if list(Draft202012Validator(msg["headers"]).iter_errors(sample_headers)):
        errors.append(f"message {name}: rejects well-formed CloudEvents headers")
for key, channel in doc["channels"].items():
    for ref in channel["messages"].values():
        resolve(ref["$ref"])
ops = {name: (op["action"], resolve(op["channel"]["$ref"])) for name, op in doc["operations"].items()}
sent = {ch["address"] for action, ch in ops.values() if ch and action == "send"}
for op_name, (action, ch) in ops.items():
    if action == "receive" and ch and ch["address"] not in sent:
        errors.append(f"{op_name}: receives on a channel nobody sends on")
receivers = [op for op in doc["operations"].values() if op["action"] == "receive"]
if not receivers:
    errors.append("no subscriber receives anything")
for e in errors:
    print(e, file=sys.stderr)
if errors:
    sys.exit(1)
print(f"{root / 'asyncapi.json'}: {len(doc['channels'])} channels, {len(messages)} messages, "
      f"{len(receivers)} subscriptions, valid")

"""Validates OpenAPI documents (openapi-spec-validator) and the contract's
rules on them: every route has bearer security and documents the error
body; every POST requires Idempotency-Key."""
import json, sys
from openapi_spec_validator import validate

errors = []
for path in sys.argv[1:]:
    doc = json.load(open(path))
    try:
        validate(doc)
    except Exception as e:  # the validator's message says what is wrong
        errors.append(f"{path}: invalid OpenAPI: {e}")
        continue
    for route, item in doc["paths"].items():
        for method, op in item.items():
            where = f"{path}: {method.upper()} {route}"
            if not op.get("security"):
                errors.append(f"{where}: no bearer security")
            if "401" not in op["responses"]:
                errors.append(f"{where}: 401 not documented")
            if method == "post":
                names = [p.get("name") for p in op.get("parameters", [])]
                if "Idempotency-Key" not in names:
                    errors.append(f"{where}: no Idempotency-Key header")
                for status in ("400", "409", "413", "422", "425"):
                    if status not in op["responses"]:
                        errors.append(f"{where}: {status} not documented")
    print(f"{path}: {len(doc['paths'])} paths, valid")
if errors:
    print("\n".join(errors))
    sys.exit(1)

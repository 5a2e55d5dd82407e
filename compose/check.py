"""Checks the compose stack where no Docker compose is available: the YAML
parses, every service the native stack runs is in it with its port, and the
Prometheus files are well-formed with an expression on every rule."""
import pathlib, re, sys
import yaml

root = pathlib.Path(__file__).resolve().parent.parent
compose = yaml.safe_load((root / "compose/docker-compose.yml").read_text())
services = compose["services"]
native = re.search(r'^SERVICES="([^"]+)"', (root / "scripts/stack.sh").read_text(), re.M).group(1).split()
errors = []
for entry in native:
    name, port = entry.split(":")
    if name not in services:
        errors.append(f"{name} runs in `make up` but is not in the compose file")
    elif not any(p.endswith(f":{port}") for p in services[name].get("ports", [])):
        errors.append(f"{name}: port {port} not published")
for dep in ("postgres", "rabbitmq", "setup", "prometheus"):
    if dep not in services:
        errors.append(f"compose file lacks {dep}")
prom = yaml.safe_load((root / "compose/prometheus/prometheus.yml").read_text())
targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
for entry in native:
    name, port = entry.split(":")
    if name != "psp-sim" and f"{name}:{port}" not in targets:
        errors.append(f"prometheus does not scrape {name}:{port}")
alerts = yaml.safe_load((root / "compose/prometheus/alerts.yml").read_text())
rules = [r for g in alerts["groups"] for r in g["rules"]]
errors += [f"rule {r.get('alert')} has no expr" for r in rules if not r.get("expr")]
if errors:
    print("\n".join(errors))
    sys.exit(1)
print(f"compose: {len(services)} services, prometheus: {len(targets)} targets, {len(rules)} alert rules: ok")

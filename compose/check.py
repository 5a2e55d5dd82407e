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
# Every process that serves HTTP binds all interfaces, or nothing outside
# its container reaches it (psp-sim once bound 127.0.0.1 whatever it was told).
app_services = [e.split(":")[0] for e in native]
for name in app_services:
    env = services.get(name, {}).get("environment", {}) or {}
    if env.get("BIND_ADDRESS") != "0.0.0.0":
        errors.append(f"{name}: BIND_ADDRESS is {env.get('BIND_ADDRESS')!r}, not 0.0.0.0")
# Every URL between services names a compose service, never localhost.
for name, svc in services.items():
    for key, value in (svc.get("environment") or {}).items():
        for host in re.findall(r"^[a-z+]+://(?:[^@/]*@)?([^:/]+)", str(value)):
            if host not in services:
                errors.append(f"{name}: {key} points at {host!r}, not a compose service")
    # Healthchecks on every long-running service others wait on.
    if name in app_services and name != "psp-sim" and "healthcheck" not in svc:
        errors.append(f"{name}: no healthcheck")
# Published host ports are unique.
published = {}
for name, svc in services.items():
    for p in svc.get("ports", []):
        host_port = str(p).rsplit(":", 1)[0].rsplit(":", 1)[-1]
        if host_port in published:
            errors.append(f"host port {host_port} published by {published[host_port]} and {name}")
        published[host_port] = name
if not (root / ".dockerignore").exists() or "target" not in (root / ".dockerignore").read_text():
    errors.append(".dockerignore must exclude target/ (the build context would be gigabytes)")
alerts = yaml.safe_load((root / "compose/prometheus/alerts.yml").read_text())
rules = [r for g in alerts["groups"] for r in g["rules"]]
errors += [f"rule {r.get('alert')} has no expr" for r in rules if not r.get("expr")]
if errors:
    print("\n".join(errors))
    sys.exit(1)
print(f"compose: {len(services)} services, prometheus: {len(targets)} targets, {len(rules)} alert rules: ok")

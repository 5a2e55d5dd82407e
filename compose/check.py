"""Checks the compose stack where no Docker compose is available: the YAML
parses, every service the native stack runs is in it with its port, and the
Prometheus files are well-formed with an expression on every rule, and
Grafana's provisioning matches its dashboard."""
import pathlib, re, sys
import yaml

root = pathlib.Path(__file__).resolve().parent.parent
compose = yaml.safe_load((root / "compose/docker-compose.yml").read_text())
services = compose["services"]
# The one list of the services (services/roster.txt), and the provider's
# simulator, which `make up` runs beside them.
roster = [line.split("#")[0].split() for line in (root / "services/roster.txt").read_text().splitlines()]
roster = [fields for fields in roster if fields]
native = ["psp-sim:8090"] + [f"{name}:{port}" for name, port, _ in roster]
errors = []
for entry in native:
    name, port = entry.split(":")
    if name not in services:
        errors.append(f"{name} runs in `make up` but is not in the compose file")
    elif not any(p.endswith(f":{port}") for p in services[name].get("ports", [])):
        errors.append(f"{name}: port {port} not published")
# Every binary a service of the image runs is one the Dockerfile copies in.
dockerfile = (root / "compose/Dockerfile").read_text()
copied = set(re.findall(r"target/release/([a-z-]+)", dockerfile))
for name, service in services.items():
    command = service.get("command")
    if isinstance(command, list) and command and service.get("image") == compose["x-service"]["image"]:
        if command[0] not in copied:
            errors.append(f"{name} runs `{command[0]}`, which compose/Dockerfile does not copy into the image")
# setup makes every service's database, and every service finds its own.
setup = services.get("setup", {}).get("command", [])
shared_env = compose["x-service"]["environment"]
for name, _, _ in roster:
    if name not in setup:
        errors.append(f"setup does not make {name}'s database")
    var = name.upper().replace("-", "_") + "_DATABASE_URL"
    if var not in shared_env and var not in (services.get(name, {}).get("environment") or {}):
        errors.append(f"{name} has no {var}")
for dep in ("postgres", "rabbitmq", "setup", "prometheus", "alertmanager", "grafana"):
    if dep not in services:
        errors.append(f"compose file lacks {dep}")
prom = yaml.safe_load((root / "compose/prometheus/prometheus.yml").read_text())
targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
if "rabbitmq:15692" not in jobs.get("rabbitmq", {}).get("static_configs", [{}])[0].get("targets", []):
    errors.append("prometheus does not scrape RabbitMQ's endpoint (rabbitmq:15692)")
plugins = (root / "compose/rabbitmq-enabled-plugins").read_text()
if "rabbitmq_prometheus" not in plugins:
    errors.append("compose/rabbitmq-enabled-plugins lacks rabbitmq_prometheus")
# Grafana: the datasource the dashboard names is the one provisioned, and
# the dashboard folder is the one mounted. (Which metrics each query reads is
# checked against the code's catalogue by e2e/tests/observability.rs.)
import json
dashboard = json.loads((root / "compose/grafana/dashboards/commerce.json").read_text())
datasources = yaml.safe_load((root / "compose/grafana/provisioning/datasources/prometheus.yml").read_text())
uids = {d["uid"] for d in datasources["datasources"]}
for panel in dashboard["panels"]:
    for target in panel.get("targets", []):
        if target["datasource"]["uid"] not in uids:
            errors.append(f"panel {panel['title']!r}: datasource {target['datasource']['uid']!r} not provisioned")
provider = yaml.safe_load((root / "compose/grafana/provisioning/dashboards/commerce.yml").read_text())
mounts = services.get("grafana", {}).get("volumes", [])
for p in provider["providers"]:
    if not any(m.endswith(":" + p["options"]["path"] + ":ro") for m in mounts):
        errors.append(f"grafana: dashboards path {p['options']['path']} is not mounted")
for entry in native:
    name, port = entry.split(":")
    ops = int(port) + 3000  # the ops port: no API port serves /metrics
    if name != "psp-sim" and f"{name}:{ops}" not in targets:
        errors.append(f"prometheus does not scrape {name}'s ops port ({name}:{ops})")
# Every process that serves HTTP binds all interfaces, or nothing outside
# its container reaches it (psp-sim once bound 127.0.0.1 whatever it was told).
app_services = [e.split(":")[0] for e in native]
for name in app_services:
    env = services.get(name, {}).get("environment", {}) or {}
    if env.get("BIND_ADDRESS") != "0.0.0.0":
        errors.append(f"{name}: BIND_ADDRESS is {env.get('BIND_ADDRESS')!r}, not 0.0.0.0")
    if name != "psp-sim" and env.get("OPS_BIND_ADDRESS") != "0.0.0.0":
        errors.append(f"{name}: OPS_BIND_ADDRESS is {env.get('OPS_BIND_ADDRESS')!r}: Prometheus cannot scrape it")
# Every URL between services names a compose service, never localhost.
for name, svc in services.items():
    for key, value in (svc.get("environment") or {}).items():
        for host in re.findall(r"^[a-z+]+://(?:[^@/]*@)?([^:/]+)", str(value)):
            if host not in services:
                errors.append(f"{name}: {key} points at {host!r}, not a compose service")
    # Healthchecks on every long-running service others wait on.
    if name in app_services and name != "psp-sim" and "healthcheck" not in svc:
        errors.append(f"{name}: no healthcheck")
# Every container that runs our binaries is given every URL it needs, and
# waits for each server it reaches: `setup` once ran without AMQP_URL (it
# declares the broker topology) and without waiting for RabbitMQ, so it
# failed, and every service waited on it forever.
ours = {n: s for n, s in services.items() if s.get("image") == "commerce-services:dev"}
for name, svc in ours.items():
    command = " ".join(map(str, svc.get("command", [])))
    if command.startswith("psp-sim"):
        continue  # the provider simulator reaches no server
    env = svc.get("environment") or {}
    if "AMQP_URL" not in env:
        errors.append(f"{name}: runs {command.split()[0]} without AMQP_URL")
    reached = set()
    for value in list(env.values()) + list(svc.get("command", [])):
        reached.update(re.findall(r"^[a-z+]+://(?:[^@/]*@)?([^:/]+)", str(value)))
    deps = svc.get("depends_on") or {}
    for host in sorted(reached & {"postgres", "rabbitmq", "falkordb"}):
        waits = (isinstance(deps, dict) and deps.get(host, {}).get("condition") == "service_healthy") or (
            isinstance(deps, dict) and deps.get("setup", {}).get("condition") == "service_completed_successfully"
            and name != "setup" and host != "falkordb")
        if not waits:
            errors.append(f"{name}: reaches {host} but does not wait for it to be healthy")
# Alerts reach Alertmanager, and its routes name receivers it has.
managers = [t for a in (prom.get("alerting") or {}).get("alertmanagers", [])
            for c in a.get("static_configs", []) for t in c.get("targets", [])]
if not managers:
    errors.append("prometheus sends its alerts nowhere (no alerting.alertmanagers)")
for target in managers:
    if target.split(":")[0] not in services:
        errors.append(f"prometheus sends alerts to {target}, not a compose service")
am = yaml.safe_load((root / "compose/alertmanager/alertmanager.yml").read_text())
receivers = {r["name"] for r in am.get("receivers", [])}
def routes(r):
    yield r
    for sub in r.get("routes", []):
        yield from routes(sub)
for r in routes(am["route"]):
    if r.get("receiver") and r["receiver"] not in receivers:
        errors.append(f"alertmanager routes to {r['receiver']!r}, which it does not define")
if not any(m.endswith(":/etc/alertmanager/alertmanager.yml:ro") for m in services.get("alertmanager", {}).get("volumes", [])):
    errors.append("alertmanager: its configuration is not mounted")
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
print(f"compose: {len(services)} services, prometheus: {len(targets)} targets + rabbitmq, "
      f"{len(rules)} alert rules, grafana: {len(dashboard['panels'])} panels: ok")

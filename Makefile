# Commerce reliability monorepo. `make help` lists the targets.

SHELL := /bin/bash
# make deps writes .env (git-ignored) where PostgreSQL asks for passwords.
-include .env
export PG_PORT ADMIN_DATABASE_URL DB_ROLE_PASSWORD
DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/postgres
AMQP_URL ?= amqp://guest:guest@127.0.0.1:5672/%2f
export DATABASE_URL AMQP_URL

# Every target that runs the binaries builds them with this one command, so
# each reuses what the last compiled. The features decide the dependencies'
# build hashes: CI sets BUILD_FEATURES=--all-features, make test's set, so
# that the binaries and the tests share one compile of the dependencies
# instead of two (about 150 crates).
BUILD_FEATURES ?=
export BUILD_FEATURES
BUILD_BINS = cargo build --locked --workspace --bins $(BUILD_FEATURES)
RELIABILITY = $(BUILD_BINS) --quiet && $${CARGO_TARGET_DIR:-target}/debug/reliability

.PHONY: test-rabbitmq4 stock-debian reset model help build test test-clean lint audit doctor fmt roles token up down observe logs status demo verify deps fuzz-api check-compose alerts-test new-service template-check openapi e2e e2e-upgrade e2e-pgbouncer e2e-log e2e-full test-rabbitmq4-full bench bench-smoke

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

build: ## build every crate
	cargo build --workspace --all-targets --locked

test: test-clean ## run every test against the real PostgreSQL, RabbitMQ and FalkorDB (started on 127.0.0.1:6380 if need be; ~3 min on 2 cores after the build)
	@scripts/pg-tls.sh
	@scripts/falkordb.sh start
	@if command -v cargo-nextest >/dev/null; then \
	  cargo test --doc --workspace --all-features --locked && cargo nextest run --workspace --all-targets --all-features --locked; \
	else \
	  cargo test --workspace --all-targets --all-features --locked; \
	fi

# The tests whose outcome the broker's version can change (ADR 0031,
# amended; the whole workspace named, so the build is make test's): the library's, which own every AMQP call (queues and their
# delivery limits, returns, confirms, dead letters, partitions, the
# operator's queue tools and status, less what reads the management API: the chroot has none). The services reach the broker only through it.
RABBITMQ4_TESTS ?= (package(reliability) & test(/^(consumer|relay|ordered|topology|frozen)::/)) | (package(operator) & !test(/binding/) & !binary(console_browser))

test-rabbitmq4: ## the library's broker tests again on RabbitMQ 4.0 (Debian 13's package, in a chroot on 127.0.0.1:5682; scripts/rabbitmq4.sh, root): quorum queues' default delivery limit and return counting
	@url=$$(scripts/rabbitmq4.sh start) && AMQP_URL=$$url cargo nextest run --workspace --all-targets --all-features --locked -E '$(RABBITMQ4_TESTS)'; \
	  status=$$?; scripts/rabbitmq4.sh stop; exit $$status

test-rabbitmq4-full: ## make test, every test, on RabbitMQ 4.0 (part of make e2e-full)
	@url=$$(scripts/rabbitmq4.sh start) && AMQP_URL=$$url $(MAKE) --no-print-directory test; \
	  status=$$?; scripts/rabbitmq4.sh stop; exit $$status

test-clean: ## drop test databases and queues left by interrupted test runs
	@if command -v psql >/dev/null; then \
	  psql "$(DATABASE_URL)" -Atqc "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database LIKE 'reltest\_%' AND NOT active" >/dev/null; \
	  psql "$(DATABASE_URL)" -Atqc "SELECT datname FROM pg_database WHERE datname LIKE 'reltest\_%'" \
	  | while read -r db; do psql "$(DATABASE_URL)" -qc "DROP DATABASE IF EXISTS $$db WITH (FORCE)"; done; \
	fi
	@if command -v rabbitmqctl >/dev/null && rabbitmqctl -q status >/dev/null 2>&1; then \
	  queues=$$(timeout 120 rabbitmqctl -q list_queues name | grep '^reltest\.' || true); \
	  if [ -n "$$queues" ]; then $(RELIABILITY) queue delete --yes $$queues; fi; \
	fi

lint: ## rustfmt check, clippy with warnings as errors, cargo deny (licenses, bans, sources), the ADR index up to date, every path the docs name exists, no source file outside tests/ over 400 lines, the crates' layering (scripts/check_crates.py)
	python3 scripts/adr_index.py --check
	python3 scripts/check_paths.py
	python3 scripts/check_sizes.py
	python3 scripts/check_crates.py
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
	@command -v cargo-deny >/dev/null || { echo "cargo-deny is missing: cargo install cargo-deny --locked" >&2; exit 1; }
	cargo deny --locked check bans licenses sources

audit: ## cargo deny check advisories (fetches the RustSec database from GitHub)
	cargo deny --locked check advisories

fmt: ## format the code
	cargo fmt --all

roles: ## create the commerce_owner / commerce_app / commerce_relay roles
	$(RELIABILITY) setup --admin-url "$(DATABASE_URL)"

token: ## print a development JWT: make token TENANT=1
	@$(RELIABILITY) token --tenant $(or $(TENANT),1)

up: ## start the whole stack natively (local PostgreSQL and RabbitMQ); safe to run twice
	scripts/stack.sh up

observe: ## Prometheus (Debian's package) on the running stack: every process scraped, the alert rules, a page of the dashboard's panels; make down stops it
	scripts/stack.sh observe

down: ## stop exactly what `make up` started
	scripts/stack.sh down

reset: ## stop the stack and drop its databases and queues (its data is lost); then make up starts afresh
	scripts/stack.sh reset

logs: ## follow the stack's logs
	scripts/stack.sh logs

status: ## show which services of the stack run
	scripts/stack.sh status

demo: ## place a few orders on the running stack and show how each ends
	scripts/demo.sh

verify: ## the running stack's order views, ordered histories and graph against their sources (ADR 0035); exit 1 while one differs; make verify ARGS=--repair mends them
	scripts/stack.sh verify $(ARGS)

doctor: ## check every prerequisite of make up / make test and print the fix for each missing one
	@scripts/doctor.sh

deps: ## install what is missing (packages via sudo; rustup and cargo-nextest for the user), start PostgreSQL and RabbitMQ, check their versions, set up local auth (.env)
	scripts/deps.sh

stock-debian: ## prove the README's two commands on a fresh Debian root filesystem (debootstrap; SUITE=bookworm), as a user with sudo, in a network namespace of its own; root, ~40 min; prints a report
	scripts/stock-debian.sh

fuzz-api: ## schemathesis (every check) against the running stack's OpenAPI documents (make up first)
	scripts/fuzz-api.sh

check-compose: ## validate the compose stack (docker compose config where available)
	@if docker compose version >/dev/null 2>&1; then docker compose -f compose/docker-compose.yml config --quiet && echo "docker compose config: ok"; fi
	python3 compose/check.py

alerts-test: ## unit-test the alert rules: each fires on its case and not on its look-alike (promtool; Debian: apt-get install --no-install-recommends prometheus)
	@command -v promtool >/dev/null || { echo "promtool is missing: apt-get install --no-install-recommends prometheus" >&2; exit 1; }
	promtool check rules compose/prometheus/alerts.yml
	promtool test rules compose/prometheus/alerts_test.yml
	@# The scrape and alerting configuration too, its rule path made local.
	@tmp=$$(mktemp -d) && cp compose/prometheus/alerts.yml $$tmp/ && \
	  sed "s|/etc/prometheus/alerts.yml|$$tmp/alerts.yml|" compose/prometheus/prometheus.yml > $$tmp/prometheus.yml && \
	  promtool check config $$tmp/prometheus.yml; status=$$?; rm -rf $$tmp; exit $$status
	@if command -v amtool >/dev/null; then amtool check-config compose/alertmanager/alertmanager.yml; fi

new-service: ## create a service from the template: make new-service NAME=shipping [PORT=8085] [ORDERED=4 (partitions: its consumer ordered per aggregate, ADR 0028)]
	scripts/new-service.sh "$(NAME)" $(PORT) $(if $(ORDERED),--ordered $(ORDERED))

template-check: ## generate a throwaway service (its consumer ordered, the flag's path), lint it (rustfmt, clippy -D warnings), run its tests, check it is on the roster, in the stack, compose and Prometheus, remove it (CI)
	@git diff --quiet -- services/roster.txt compose Cargo.lock || { echo "template-check needs a clean services/roster.txt, compose/ and Cargo.lock" >&2; exit 1; }
	scripts/new-service.sh tmplcheck --ordered 4
	status=0; cargo fmt -p tmplcheck -- --check && cargo clippy -p tmplcheck --all-targets --all-features --locked -- -D warnings \
	  && cargo nextest run -p tmplcheck --locked && python3 compose/check.py \
	  && cargo nextest run -p contracts --locked -E 'test(roster)' && scripts/stack.sh status | grep -q '^tmplcheck:' || status=$$?; \
	  rm -rf services/tmplcheck migrations/tmplcheck; git checkout -- services/roster.txt compose Cargo.lock; exit $$status

openapi: ## write each service's OpenAPI document (target/openapi/) and the events' AsyncAPI document and JSON Schemas (target/asyncapi/), and validate them
	$(BUILD_BINS)
	mkdir -p target/openapi
	for s in $$(scripts/roster.sh names); do $${CARGO_TARGET_DIR:-target}/debug/$$s --openapi > target/openapi/$$s.json; done
	py=$$(scripts/venv.sh openapi-spec-validator)/python3 && \
	  $$py scripts/check_openapi.py target/openapi/*.json && \
	  $${CARGO_TARGET_DIR:-target}/debug/asyncapi target/asyncapi && \
	  $$py scripts/check_asyncapi.py target/asyncapi

e2e: ## crash, restart, freeze and node-loss scenarios against the stack as real processes, in a world of its own (its own PostgreSQL and 3-node RabbitMQ on ports 25401-25469; E2E_WORLD_PORT moves them); leaves the local servers alone
	$(BUILD_BINS)
	$${CARGO_TARGET_DIR:-target}/debug/e2e

# The scenarios whose outcome a transaction-mode pooler can change (ADR
# 0026, amended): the tenant set per transaction, advisory locks and
# Idempotency-Keys on shared server connections, a frozen holder of one, a
# host cut off from it, PostgreSQL restarted behind it, more clients than
# server connections, the ordered path's locks. The rest take the same
# database path; make e2e-full runs them all (E2E_PGBOUNCER_ONLY=).
E2E_PGBOUNCER_ONLY ?= baseline,Idempotency-Key,tenants,PostgreSQL restart,cut off from PostgreSQL,frozen mid-transaction,replicas,ordered: kill
E2E_PGBOUNCER_SKIP ?=

e2e-pgbouncer: ## the scenarios a pooler can change, with the runtime role through PgBouncer in transaction mode (E2E_PGBOUNCER_ONLY= for all; builds PgBouncer 1.24 from Debian's source when the system's is older than 1.21)
	$(BUILD_BINS)
	pgbouncer=$$(scripts/pgbouncer.sh) && E2E_ONLY="$(E2E_PGBOUNCER_ONLY)" E2E_SKIP="$(E2E_PGBOUNCER_SKIP)" E2E_PGBOUNCER=$$pgbouncer $${CARGO_TARGET_DIR:-target}/debug/e2e

# The scenarios a relay's mode can change (ADR 0038): its crashes and
# freezes, several relays on one outbox, a late commit, an unroutable
# event, the broker's nodes restarted, killed and out of quorum, and
# PostgreSQL restarted -m immediate while the slots are read.
E2E_LOG_ONLY ?= relay,late,unroutable,every broker node,node leading,quorum,PostgreSQL restart

e2e-log: ## the relay scenarios with RELAY_MODE=log: each outbox read from a logical replication slot (E2E_LOG_ONLY= for all)
	$(BUILD_BINS)
	E2E_RELAY_MODE=log E2E_ONLY="$(E2E_LOG_ONLY)" $${CARGO_TARGET_DIR:-target}/debug/e2e

# The release a rolling upgrade starts from: one whose relays do not number.
UPGRADE_FROM_REV ?= 953eb30

e2e-upgrade: ## a rolling upgrade under load from $(UPGRADE_FROM_REV), whose relays do not number, to this tree: every history in outbox order (builds this tree, then that release's services once, on this tree's dependencies, ~1 min; E2E_ONLY= runs every make e2e scenario after it, as CI does)
	$(BUILD_BINS)
	BASELINE_PROFILE=debug scripts/bench-baseline.sh $(UPGRADE_FROM_REV) > .upgrade-from
	from=$$(cat .upgrade-from); rm -f .upgrade-from; \
	  E2E_UPGRADE_FROM=$$from E2E_ONLY=$${E2E_ONLY-upgrade} $(MAKE) --no-print-directory e2e

e2e-full: ## the whole matrix: make e2e with the rolling upgrade, every scenario through PgBouncer, the relay scenarios with the log relay, and make test on RabbitMQ 4 (about an hour more than CI's share)
	E2E_ONLY= $(MAKE) --no-print-directory e2e-upgrade
	$(MAKE) --no-print-directory e2e-pgbouncer E2E_PGBOUNCER_ONLY=
	$(MAKE) --no-print-directory e2e-log
	$(MAKE) --no-print-directory test-rabbitmq4-full

# The bench also runs the stack as processes (per-role RSS): their binaries too.
SERVICE_PKGS = $(patsubst %,-p %,$(shell scripts/roster.sh names)) -p psp-sim

# The saga also runs through a build of the main issue 44 was written
# against (issue 24's was 953eb30), in the same run, with the same
# subscriptions (BENCH_BASELINE_REV=none skips it).
BENCH_BASELINE_REV ?= f3ff5b8

bench: ## measure the system against raw PostgreSQL/RabbitMQ limits (release, about 10 min after the build); rewrites docs/benchmarks.md
	if [ "$(BENCH_BASELINE_REV)" != none ]; then scripts/bench-baseline.sh $(BENCH_BASELINE_REV) > .bench-baseline; else : > .bench-baseline; fi
	cargo build --locked --release -p bench $(SERVICE_PKGS)
	scripts/falkordb.sh start
	baseline=$$(cat .bench-baseline); rm -f .bench-baseline; \
	  BENCH_BASELINE=$$baseline BENCH_BASELINE_REV=$(BENCH_BASELINE_REV) $${CARGO_TARGET_DIR:-target}/release/bench

bench-smoke: ## the bench in miniature (seconds, debug build): what CI runs so it cannot rot
	$(BUILD_BINS)
	scripts/falkordb.sh start
	$${CARGO_TARGET_DIR:-target}/debug/bench --smoke

model: ## the payment state machine's model test over many seeds (MODEL_SEEDS=2000; make test runs 200)
	MODEL_SEEDS=$(or $(MODEL_SEEDS),2000) cargo nextest run -p payments --locked -E 'test(money_follows_the_order)' --no-capture

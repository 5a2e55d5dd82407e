#!/usr/bin/env bash
# A RabbitMQ 4 beside the local one, for `make test-rabbitmq4`: Debian 13's
# rabbitmq-server package (4.0) in a root filesystem that debootstrap builds
# from Debian's packages, run in a chroot on ports of its own (AMQP 5682,
# epmd 4380, distribution 25682). RabbitMQ 4 changed what quorum queues do
# by default (a delivery limit of 20 on every queue, a return counted as a
# delivery); the suite must hold there too. Root only.
#   scripts/rabbitmq4.sh start   build the root filesystem once, start the broker, print its AMQP URL
#   scripts/rabbitmq4.sh stop    stop it and unmount (the root filesystem stays for the next start)
set -euo pipefail
ROOT=${RABBITMQ4_ROOT:-/var/tmp/commerce-rabbitmq4}
PORT=${RABBITMQ4_PORT:-5682}
EPMD_PORT=${RABBITMQ4_EPMD_PORT:-4380}
SUITE=trixie
MIRROR=${MIRROR:-http://deb.debian.org/debian}

say() { echo "rabbitmq4: $*" >&2; }
[ "$(id -u)" = 0 ] || { say "needs root (debootstrap, chroot)"; exit 1; }

in_root() {
  chroot "$ROOT" env HOME=/var/lib/rabbitmq RABBITMQ_NODE_PORT="$PORT" ERL_EPMD_PORT="$EPMD_PORT" \
    RABBITMQ_DIST_PORT=$((PORT + 20000)) RABBITMQ_NODENAME=rabbit@localhost "$@"
}
answers() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }

start() {
  if [ ! -x "$ROOT/usr/sbin/rabbitmq-server" ]; then
    command -v debootstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; }
    say "building a Debian $SUITE root filesystem with rabbitmq-server in $ROOT (about a minute)"
    rm -rf "$ROOT"
    # The package scripts must not start the broker: no init system here.
    debootstrap --variant=minbase --include=rabbitmq-server "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 \
      || { tail -20 "$ROOT.log" >&2; exit 1; }
    printf '127.0.0.1 localhost\n' >"$ROOT/etc/hosts"
  fi
  mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
  mountpoint -q "$ROOT/dev" || mount --rbind /dev "$ROOT/dev"
  if ! answers; then
    in_root rabbitmq-server -detached
    # await_startup refuses a node still in prelaunch (not yet known to
    # epmd), and a first start initialises its database: the port first,
    # within 120 s.
    local deadline=$((SECONDS + 120))
    until answers; do
      ((SECONDS < deadline)) || { say "no AMQP port on $PORT after 120 s: see $ROOT/var/log/rabbitmq/"; exit 1; }
      sleep 1
    done
    in_root timeout 120 rabbitmqctl -q await_startup
    in_root rabbitmq-plugins -q enable rabbitmq_consistent_hash_exchange >/dev/null
  fi
  say "$(in_root rabbitmq-diagnostics -q server_version | tail -1) on 127.0.0.1:$PORT"
}

stop() {
  if [ -d "$ROOT" ]; then
    in_root rabbitmqctl -q stop >/dev/null 2>&1 || true
    # Whatever still runs inside the root filesystem (its epmd): chosen by
    # its root, never by name, which would reach the host's own epmd.
    for p in /proc/[0-9]*; do
      [ "$(readlink "$p/root" 2>/dev/null)" = "$ROOT" ] && kill -9 "${p#/proc/}" 2>/dev/null || true
    done
    for m in dev proc; do
      mountpoint -q "$ROOT/$m" && umount -lR "$ROOT/$m" || true
    done
  fi
}

case ${1:-} in
  # Standard output carries the URL alone (callers take it with $(...)):
  # whatever apt, debootstrap or the broker's tools print goes to stderr.
  # Not `start >&2 && echo`: inside an && list bash suspends set -e for
  # the whole function, and a failed step would still print the URL.
  start)
    start >&2
    echo "amqp://guest:guest@127.0.0.1:$PORT/%2f"
    ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac

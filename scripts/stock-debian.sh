#!/usr/bin/env bash
# make stock-debian: the README's two commands (`./dev up`, `./dev test`) on
# a fresh Debian, as a new user would run them, and a report of how long each
# step took. The machine is built here from Debian's packages:
#
#   1. debootstrap a Debian root filesystem (SUITE, default bookworm: Debian
#      12), with only sudo and ca-certificates beyond Debian's own choice of
#      required and important packages: no make, Rust, PostgreSQL, RabbitMQ,
#      pip or git;
#   2. a user, `dev`, with sudo, and this commit's checkout in its home
#      (cloned by the host's git, owned by the user);
#   3. WHAT IS NOT STOCK, said plainly: the host's stable Rust toolchain
#      copied into the user's ~/.rustup and ~/.cargo, because these machines
#      cannot reach rustup's host (`./dev` would run rustup's installer
#      there instead); and the certificate authorities the host added to its
#      own trust (/usr/local/share/ca-certificates), because this network
#      inspects TLS. Nothing else is copied: no crate cache, no cargo-nextest;
#   4. a network namespace of its own (its own 127.0.0.1, so its PostgreSQL
#      and RabbitMQ take their default ports beside the host's), reaching
#      Debian's mirror, crates.io and PyPI through the host by NAT;
#   5. as `dev`, in that namespace: `./dev up`, `make demo`, `make down`,
#      `./dev test`; then a check that the checkout holds no file of root's.
#
# The box has no init system: Debian's package scripts are told not to start
# services (policy-rc.d), as in a container; `./dev` starts PostgreSQL and
# RabbitMQ itself, as it does on a machine without systemd.
#
# Needs root on the host, debootstrap and nftables (it installs them), about
# 6 GB under STOCK_DIR and 30-45 minutes on 2 cores (most of it compiling).
# Everything it started is stopped and unmounted at the end, and the root
# filesystem is removed (STOCK_KEEP=1 keeps it for a look): with its
# build it holds several GB, on a disk the next build may need.
set -euo pipefail
cd "$(dirname "$0")/.."
checkout=$(pwd)

SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
STOCK_DIR=${STOCK_DIR:-/var/tmp/commerce-stock}
root=$STOCK_DIR/$SUITE
ns=stockdeb
net=10.213.7
report=$STOCK_DIR/report-$SUITE.txt

say() { printf '\n== %s\n' "$*"; }
[ "$(id -u)" = 0 ] || { echo "stock-debian needs root (debootstrap, chroot, a network namespace)" >&2; exit 1; }

missing=()
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v nft >/dev/null || missing+=(nftables)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

mkdir -p "$STOCK_DIR"
: >"$report"
step_start=0
begin() { step=$1; step_start=$SECONDS; say "$step"; }
end() {
  local took=$((SECONDS - step_start))
  printf '%-58s %4d:%02d\n' "$step" $((took / 60)) $((took % 60)) | tee -a "$report"
}

stop_box() {
  # Whatever runs in the box: its servers were started by ./dev.
  if ip netns pids "$ns" >/dev/null 2>&1; then
    ip netns pids "$ns" | xargs -r kill -9 2>/dev/null || true
  fi
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && kill -9 "${p#/proc/}" 2>/dev/null || true
  done
  sleep 1
  for m in dev/pts dev proc sys; do
    mountpoint -q "$root/$m" && umount -lR "$root/$m" 2>/dev/null || true
  done
  ip netns del "$ns" 2>/dev/null || true
  ip link del "$ns-h" 2>/dev/null || true
  nft delete table ip "$ns" 2>/dev/null || true
}
cleanup() {
  stop_box
  if [ "${STOCK_KEEP:-0}" = 0 ]; then rm -rf "$root"; fi
}
trap cleanup EXIT

stop_box
rm -rf "$root"
mkdir -p "$STOCK_DIR"

begin "debootstrap $SUITE from $MIRROR"
debootstrap --include=sudo,ca-certificates "$SUITE" "$root" "$MIRROR" >"$STOCK_DIR/debootstrap.log" 2>&1 \
  || { tail -20 "$STOCK_DIR/debootstrap.log"; exit 1; }
end

begin "the user dev (sudo), the checkout, and the host's Rust toolchain"
# No init system in the box: package scripts must not try to start services.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
cp /etc/resolv.conf "$root/etc/resolv.conf"
# The other step that is not stock, where the host's network needs it: the
# certificate authorities this host added (a network that inspects TLS has
# one), so that the box reaches crates.io and PyPI as the host does.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
fi
printf '127.0.0.1 localhost\n127.0.1.1 %s\n' "$(hostname)" >"$root/etc/hosts"
chroot "$root" useradd --create-home --shell /bin/bash --uid 1000 dev
echo 'dev ALL=(ALL) NOPASSWD:ALL' >"$root/etc/sudoers.d/dev"
chmod 440 "$root/etc/sudoers.d/dev"
git clone -q --no-local "$checkout" "$root/home/dev/commerce"
# The one step that is not stock (see the header): rustup's host is out of
# reach here, so the host's stable toolchain goes where rustup would put it.
toolchain=$(rustup show active-toolchain 2>/dev/null | awk '{print $1}')
rustup_home=${RUSTUP_HOME:-$HOME/.rustup}
cargo_home=${CARGO_HOME:-$HOME/.cargo}
mkdir -p "$root/home/dev/.rustup/toolchains" "$root/home/dev/.cargo/bin"
cp -a "$rustup_home/toolchains/$toolchain" "$root/home/dev/.rustup/toolchains/"
printf 'version = "12"\ndefault_toolchain = "%s"\nprofile = "minimal"\n' "$toolchain" \
  >"$root/home/dev/.rustup/settings.toml"
for b in cargo cargo-clippy cargo-fmt clippy-driver rustc rustdoc rustfmt rustup; do
  cp -a "$cargo_home/bin/$b" "$root/home/dev/.cargo/bin/"
done
cp "$cargo_home/env" "$root/home/dev/.cargo/env"
echo '. "$HOME/.cargo/env"' >>"$root/home/dev/.profile"
chroot "$root" chown -R dev:dev /home/dev
end

begin "a network namespace of its own, NAT to the mirrors"
ip netns add "$ns"
ip link add "$ns-h" type veth peer name "$ns-b"
ip link set "$ns-b" netns "$ns"
ip addr add "$net.1/30" dev "$ns-h"
ip link set "$ns-h" up
ip -n "$ns" addr add "$net.2/30" dev "$ns-b"
ip -n "$ns" link set "$ns-b" up
ip -n "$ns" link set lo up
ip -n "$ns" route add default via "$net.1"
sysctl -qw net.ipv4.ip_forward=1
nft -f - <<NFT
table ip $ns {
  chain postrouting {
    type nat hook postrouting priority srcnat;
    ip saddr $net.0/30 oifname != "$ns-h" masquerade
  }
  chain forward {
    type filter hook forward priority filter;
    iifname "$ns-h" accept
    oifname "$ns-h" ct state established,related accept
  }
}
NFT
mount -t proc proc "$root/proc"
mount -t sysfs sys "$root/sys"
mount --rbind /dev "$root/dev"
end

as_dev() { # as_dev COMMAND: a login shell of dev's in the box, in the checkout
  ip netns exec "$ns" chroot "$root" /bin/su - dev -c "cd ~/commerce && $1"
}

begin "what the box lacks (it must lack all of these)"
as_dev 'for c in make cargo-nextest psql rabbitmqctl pip pip3 git; do command -v $c && { echo "the box has $c" >&2; exit 1; }; done; echo none of make, cargo-nextest, psql, rabbitmqctl, pip, git'
as_dev 'cargo --version'
end

begin "./dev up (installs what is missing, then the stack)"
as_dev './dev up'
end

begin "make demo, make down"
as_dev 'make demo && make down'
end

begin "./dev test"
as_dev './dev test'
end

begin "no file in the checkout or the user's home belongs to root"
found=$(find "$root/home/dev" -xdev -uid 0 -print | head -20)
[ -z "$found" ] || { echo "root-owned: $found" >&2; exit 1; }
end

say "report ($report)"
cat "$report"
echo "stock-debian: ok ($SUITE)"

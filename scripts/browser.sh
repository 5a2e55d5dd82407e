#!/usr/bin/env bash
# What the console's browser tests need (libs/operator/tests/console_browser.rs):
# Debian's chromium, and playwright-core from npm at the version the lock
# file pins. Never a browser download: Playwright drives the system's.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null; then
  echo "browser: installing Debian's chromium" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
fi
command -v node >/dev/null || { apt-get update -qq && apt-get install -y -qq nodejs npm; }
dir=libs/operator/tests/browser
if [ ! -d "$dir/node_modules/playwright-core" ]; then
  echo "browser: npm ci in $dir (playwright-core)" >&2
  (cd "$dir" && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --silent)
fi

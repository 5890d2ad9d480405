#!/usr/bin/env bash
# Sets up from nothing (virtualenv, package, embedded model, Debian's prometheus for promtool and the
# scrape test) and runs the whole test suite, listing its 25 slowest tests (the suite should stay under 20
# minutes on 2 cores: the list says where to trim). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus >/dev/null
  # The Debian package starts a system Prometheus on :9090; the tests run their own.
  $SUDO systemctl stop prometheus >/dev/null 2>&1 || $SUDO service prometheus stop >/dev/null 2>&1 || true
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"

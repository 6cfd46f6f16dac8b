#!/usr/bin/env bash
# Check Meridian's Prometheus alert rules and the example scrape config with promtool.
#
# promtool comes with Debian's `prometheus` package (Debian has no promtool-only package);
# when promtool is missing this script installs it with apt-get, without recommended packages
# (so no node exporter). In a container the package's service is not started (policy-rc.d);
# on a host with systemd it would be: install promtool yourself there.
#
# Usage: scripts/check-alert-rules.sh [extra promtool test-rules files...]
# Exit codes: 0 ok, 1 a check failed, 3 promtool is missing and cannot be installed here.
set -euo pipefail
cd "$(dirname "$0")/.."

RULES=deploy/prometheus/alerts.yml
CONFIG=deploy/prometheus/prometheus.yml

if ! command -v promtool >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "check-alert-rules: promtool not found and apt-get unavailable;" \
             "install promtool (Prometheus release tarball) and re-run" >&2
        exit 3
    fi
    SUDO=()
    if [ "$(id -u)" -ne 0 ]; then
        if ! command -v sudo >/dev/null 2>&1; then
            echo "check-alert-rules: promtool not found; need root or sudo to apt-get install" \
                 "prometheus" >&2
            exit 3
        fi
        SUDO=(sudo)
    fi
    echo "check-alert-rules: promtool not found; installing Debian's prometheus package" >&2
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

promtool --version 2>&1 | head -n 1
promtool check rules "$RULES"
promtool check config "$CONFIG"
for tests in "$@"; do
    promtool test rules "$tests"
done

#!/usr/bin/env bash
# Install the Prometheus server and promtool (Debian's `prometheus` package) when missing.
# The integration tests start and stop their own server; this only installs the binaries.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# --no-install-recommends: the server and promtool only; the package's service is not started
# here (no systemd), and the tests run their own instance on loopback.
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v prometheus && command -v promtool

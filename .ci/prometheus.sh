#!/usr/bin/env bash
# Installs Debian's prometheus package when no prometheus binary is present, so the
# tests marked `prometheus` can run the dashboard's PromQL against a real server.
# Idempotent; never starts the system service (tests/prom.py starts its own instance).
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ]; then
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive

# policy-rc.d exit 101 tells the package's maintainer scripts not to start the daemon;
# only install our own when the machine has none, and remove it again afterwards.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod +x "$policy"
    own_policy=1
fi
cleanup() { if [ "$own_policy" = 1 ]; then rm -f "$policy"; fi; }
trap cleanup EXIT

apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null

prometheus --version 2>&1 | head -n 1

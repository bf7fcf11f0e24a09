#!/usr/bin/env bash
# Installs Prometheus and promtool for the Prometheus lane of the tests (tests/prometheus,
# marker `prometheus`) from Debian's `prometheus` package (Prometheus 2.42 on bookworm).
# Idempotent: does nothing when `prometheus` and `promtool` are already on PATH.
# The package's own service is not started (policy-rc.d denies it while installing): the lane
# runs its own Prometheus on a free loopback port. On a host with systemd the package still
# enables the service for the next boot; `systemctl disable prometheus` if you do not want it.
# Needs root or sudo, and apt-get (Debian or Ubuntu).
set -euo pipefail

if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    echo "prometheus: already installed: $(prometheus --version 2>&1 | head -n 1)"
    exit 0
fi
command -v apt-get >/dev/null || {
    echo "no apt-get here: put Prometheus 2.x's prometheus and promtool on PATH by hand" >&2
    exit 1
}
as_root=()
if (( EUID != 0 )); then
    command -v sudo >/dev/null || { echo "apt-get needs root: run as root or install sudo" >&2; exit 1; }
    as_root=(sudo)
fi

policy=/usr/sbin/policy-rc.d
if [[ ! -e "$policy" ]]; then
    # Exit status 101 tells invoke-rc.d and deb-systemd-invoke not to start services.
    printf '#!/bin/sh\nexit 101\n' | "${as_root[@]}" tee "$policy" >/dev/null
    "${as_root[@]}" chmod 755 "$policy"
    trap '"${as_root[@]}" rm -f "$policy"' EXIT
fi

start=$SECONDS
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
echo "prometheus: installed $(prometheus --version 2>&1 | head -n 1) in $((SECONDS - start)) s"
promtool --version >/dev/null

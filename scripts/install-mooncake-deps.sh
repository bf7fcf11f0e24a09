#!/usr/bin/env bash
# Installs what the `disaggregation` extra's transfer library needs besides its wheel: Mooncake's
# Transfer Engine module links Debian's libibverbs1 even for its TCP transport (with no RDMA
# device it logs "No RDMA devices found" and goes on). The lane of prefill/decode
# disaggregation (marker `disaggregation`) needs it to import `mooncake.engine`.
# Idempotent: does nothing when libibverbs.so.1 is already known to the loader.
# Needs root or sudo, and apt-get (Debian or Ubuntu).
set -euo pipefail

if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    echo "libibverbs1: already installed"
    exit 0
fi
command -v apt-get >/dev/null || {
    echo "no apt-get here: install your distribution's libibverbs (rdma-core) by hand" >&2
    exit 1
}
as_root=()
if (( EUID != 0 )); then
    command -v sudo >/dev/null || { echo "apt-get needs root: run as root or install sudo" >&2; exit 1; }
    as_root=(sudo)
fi
"${as_root[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq libibverbs1

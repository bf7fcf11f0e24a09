#!/usr/bin/env bash
# Installs the PostgreSQL server that the PostgreSQL lane (tests marked `postgres`: the shared
# Responses store, --response-store postgresql://...) starts: Debian's `postgresql` package,
# whose initdb and pg_ctl live under /usr/lib/postgresql/<major>/bin. The tests start a
# throwaway cluster of their own in a temporary directory on a free port (no service is
# enabled or started here), and skip, saying so, where the binaries are missing.
# Idempotent: nothing is installed when initdb is already there. Needs root (apt-get).
# Usage: scripts/install-postgres.sh
set -euo pipefail

find_initdb() {
    compgen -G "/usr/lib/postgresql/*/bin/initdb" | sort -V | tail -n 1
}

if [[ -z "$(find_initdb)" ]]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # The server binaries only: Debian's package would create (and try to start) a cluster of
    # its own, which the tests do not use.
    apt-get install -y -qq --no-install-recommends postgresql-common >/dev/null
    mkdir -p /etc/postgresql-common/createcluster.d
    echo "create_main_cluster = false" \
        >/etc/postgresql-common/createcluster.d/deepinfer-server-tests.conf
    apt-get install -y -qq --no-install-recommends postgresql >/dev/null
fi
initdb="$(find_initdb)"
[[ -n "$initdb" ]] || { echo "install-postgres: no initdb after installing postgresql" >&2; exit 1; }
echo "installed: $("$initdb" --version) -> $(dirname "$initdb")"

#!/usr/bin/env bash
# Installs the Shepherd Model Gateway (PyPI `smg`, a Rust binary in a wheel) that the
# prefill/decode lane puts in front of a prefill and a decode server
# (`smg launch --pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL`).
# It goes into a virtual environment of its own: its `smg` script clashes with the one that
# sglang-router (the `routers` extra) installs. The tests find it at $SMG_BIN, default
# $SMG_PREFIX/bin/smg; SMG_PREFIX defaults to ~/.cache/deepinfer-server/smg, kept between runs.
# Idempotent: nothing is installed when the pinned version is already there.
# Usage: scripts/install-smg.sh    Environment: SMG_PREFIX, PYTHON (default python3).
set -euo pipefail

SMG_VERSION=1.13.0

prefix="${SMG_PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/deepinfer-server/smg}"
python="${PYTHON:-python3}"

installed_version() {  # the smg version in the prefix's venv, or nothing
    [[ -x "$prefix/bin/python" ]] || return 0
    "$prefix/bin/python" -c 'from importlib.metadata import version; print(version("smg"))' \
        2>/dev/null || true
}

start=$SECONDS
if [[ "$(installed_version)" == "$SMG_VERSION" ]]; then
    echo "smg: $SMG_VERSION already installed in $prefix"
else
    echo "smg: installing $SMG_VERSION into $prefix"
    mkdir -p "$(dirname "$prefix")"
    "$python" -m venv --clear "$prefix"
    "$prefix/bin/pip" install --quiet --disable-pip-version-check "smg==$SMG_VERSION"
fi
"$prefix/bin/smg" launch --help >/dev/null \
    || { echo "smg: $prefix/bin/smg does not run" >&2; exit 1; }
echo "installed: smg $(installed_version) -> $prefix/bin/smg (done in $((SECONDS - start)) s)"

#!/usr/bin/env bash
# Container entrypoint: raise the limits DeepInfer needs, then exec the server so that signals
# (docker stop's SIGTERM) reach it directly.
#   - locked memory unlimited: RDMA registration of the Engram tables and DeepEP buffers;
#   - stack 64 MiB: deep recursion in kernel JIT compilation.
# DEEPINFER_MEMLOCK_LIMIT (KiB or "unlimited") and DEEPINFER_STACK_LIMIT_KB override the values.
set -euo pipefail

raise_limit() {
    local flag="$1" value="$2" name="$3" docker_flag="$4"
    if ! ulimit "$flag" "$value" 2>/dev/null; then
        echo "deepinfer-server entrypoint: error: cannot raise the ${name} limit to ${value}" \
            "(soft $(ulimit -S "$flag"), hard $(ulimit -H "$flag")). Start the container with" \
            "${docker_flag} (docker run), or give it CAP_SYS_RESOURCE." >&2
        exit 1
    fi
}

raise_limit -l "${DEEPINFER_MEMLOCK_LIMIT:-unlimited}" "locked-memory" "--ulimit memlock=-1"
raise_limit -s "${DEEPINFER_STACK_LIMIT_KB:-65536}" "stack" "--ulimit stack=67108864"
exec deepinfer-server "$@"

#!/usr/bin/env bash
# Installs the real clients that the client test lane (tests/clients, marker `clients`) drives:
#   - npm: Claude Code, Codex CLI, OpenCode, Qwen Code and the Vercel AI SDK (ai, @ai-sdk/openai,
#     @ai-sdk/openai-compatible, zod), into a project-local prefix (default .test-clients/);
#   - pip: LiteLLM and LangChain's OpenAI integration, into the current Python environment;
#     GuideLLM into a virtual environment of its own under the prefix (guidellm/: its
#     dependencies, transformers 5 among them, clash with the `grammar` extra's pins).
# Idempotent: a client already installed at the pinned version is skipped.
# Usage: scripts/install-test-clients.sh [--npm-only | --pip-only]
# Environment: TEST_CLIENTS_PREFIX (npm prefix), PYTHON (interpreter whose environment gets the
# pip packages; default: python on PATH, i.e. the active virtual environment), UV (a uv
# executable to install them with instead of pip).
set -euo pipefail

CLAUDE_CODE_VERSION=2.1.332
CODEX_VERSION=0.171.0
OPENCODE_VERSION=1.18.33
QWEN_CODE_VERSION=0.15.10
# The AI SDK 6 line (AI SDK 7 needs Node 22; Debian's nodejs is 20): its default provider
# (createOpenAI: the Responses API with store: true) and createOpenAICompatible.
AI_SDK_PACKAGES=(
    "ai@6.0.325" "@ai-sdk/openai@3.0.141" "@ai-sdk/openai-compatible@2.0.92" "zod@4.6.7"
)
GUIDELLM_VERSION=0.8.1
PIP_REQUIREMENTS=(
    "litellm>=1.110,<1.111"
    "langchain-openai>=1.7.4,<1.8"
)

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${TEST_CLIENTS_PREFIX:-$here/.test-clients}"
python="${PYTHON:-python}"
do_npm=1
do_pip=1
case "${1:-}" in
    --npm-only) do_pip=0 ;;
    --pip-only) do_npm=0 ;;
    "") ;;
    *) echo "usage: $0 [--npm-only | --pip-only]" >&2; exit 2 ;;
esac

installed_npm_version() {  # package name -> its installed version under the prefix, or nothing
    local manifest="$prefix/node_modules/$1/package.json"
    [[ -f "$manifest" ]] || return 0
    node -e 'process.stdout.write(require(process.argv[1]).version)' "$manifest"
}

start=$SECONDS
if (( do_npm )); then
    command -v npm >/dev/null || { echo "npm is not installed: apt-get install -y nodejs npm" >&2; exit 1; }
    mkdir -p "$prefix"
    wanted=()
    for spec in "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION" \
        "opencode-ai@$OPENCODE_VERSION" "@qwen-code/qwen-code@$QWEN_CODE_VERSION" \
        "${AI_SDK_PACKAGES[@]}"; do
        name="${spec%@*}"
        version="${spec##*@}"
        if [[ "$(installed_npm_version "$name")" == "$version" ]]; then
            echo "npm: $name $version already installed in $prefix"
        else
            wanted+=("$spec")
        fi
    done
    if (( ${#wanted[@]} )); then
        echo "npm: installing ${wanted[*]} into $prefix"
        # --foreground-scripts: Claude Code's and OpenCode's postinstalls put their native
        # binaries in place.
        npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error \
            --foreground-scripts "${wanted[@]}"
    fi
    for package in "${AI_SDK_PACKAGES[@]}"; do
        echo "installed: ${package%@*} $(installed_npm_version "${package%@*}")"
    done
    for bin in claude codex opencode qwen; do
        "$prefix/node_modules/.bin/$bin" --version </dev/null 2>/dev/null | tail -n 1 \
            | sed "s|^|installed: $bin -> |" \
            || { echo "npm: $prefix/node_modules/.bin/$bin does not run" >&2; exit 1; }
    done
fi

if (( do_pip )); then
    missing=()
    for requirement in "${PIP_REQUIREMENTS[@]}"; do
        if "$python" - "$requirement" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
from packaging.requirements import Requirement
req = Requirement(sys.argv[1])
sys.exit(0 if req.specifier.contains(version(req.name), prereleases=True) else 1)
PY
            echo "pip: $requirement already satisfied"
        else
            missing+=("$requirement")
        fi
    done
    if (( ${#missing[@]} )); then
        echo "pip: installing ${missing[*]} with $("$python" -c 'import sys; print(sys.executable)')"
        if [[ -n "${UV:-}" ]]; then  # uv, where the caller has it (CI does): seconds, not minutes
            "$UV" pip install --quiet --compile-bytecode --python "$python" "${missing[@]}"
        else
            "$python" -m pip install --quiet --disable-pip-version-check "${missing[@]}"
        fi
    fi
    "$python" - <<'PY'
from importlib.metadata import version
for name in ("litellm", "langchain-openai", "langchain-core", "openai", "anthropic"):
    print(f"installed: {name} {version(name)}")
PY
    guidellm="$prefix/guidellm"
    if [[ "$("$guidellm/bin/guidellm" --version 2>/dev/null)" == *"$GUIDELLM_VERSION"* ]]; then
        echo "pip: guidellm $GUIDELLM_VERSION already installed in $guidellm"
    else
        echo "pip: installing guidellm $GUIDELLM_VERSION into $guidellm"
        mkdir -p "$prefix"
        "$python" -m venv --clear "$guidellm"
        # torch pinned as in pyproject.toml: the CPU build at hand, not the newest.
        "$guidellm/bin/pip" install --quiet --disable-pip-version-check \
            "guidellm==$GUIDELLM_VERSION" "torch==2.13.0"
    fi
    echo "installed: guidellm -> $("$guidellm/bin/guidellm" --version)"
fi
echo "done in $((SECONDS - start)) s"

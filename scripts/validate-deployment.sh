#!/usr/bin/env bash
# What an operator runs on the GPU host once deepinfer-server is up:
#   scripts/validate-deployment.sh BASE_URL [EXPECTED_MAX_MODEL_LEN]
# 1. scripts/smoke.py: /health, /v1/models, one JSON and one streamed chat completion;
# 2. a streamed tool-call request (tool_choice "required", thinking off) that must come back as
#    a parsed get_weather call with JSON arguments;
# 3. /v1/models reports max_model_len (equal to EXPECTED_MAX_MODEL_LEN when given).
# Set API_KEY when the server requires one. Exit code 0 only if every check passes.
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 BASE_URL [EXPECTED_MAX_MODEL_LEN]" >&2
    exit 2
fi
BASE_URL="${1%/}"
EXPECTED_MAX_MODEL_LEN="${2:-}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"

smoke_args=(--base-url "$BASE_URL")
if [ -n "${API_KEY:-}" ]; then
    smoke_args+=(--api-key "$API_KEY")
fi
"$PYTHON" "$HERE/smoke.py" "${smoke_args[@]}"

BASE_URL="$BASE_URL" EXPECTED_MAX_MODEL_LEN="$EXPECTED_MAX_MODEL_LEN" "$PYTHON" - <<'PY'
import json
import os
import sys
import urllib.request

base = os.environ["BASE_URL"]
expected = os.environ.get("EXPECTED_MAX_MODEL_LEN") or None
headers = {"Content-Type": "application/json"}
if os.environ.get("API_KEY"):
    headers["Authorization"] = f"Bearer {os.environ['API_KEY']}"


def call(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=300) as response:
        return response.read().decode()


failures = 0
models = json.loads(call("/v1/models"))["data"]
model = models[0]["id"]
max_model_len = models[0].get("max_model_len")
if not isinstance(max_model_len, int) or max_model_len <= 0:
    failures += 1
    print(f"FAIL /v1/models max_model_len: {max_model_len!r}")
elif expected is not None and max_model_len != int(expected):
    failures += 1
    print(f"FAIL /v1/models max_model_len: {max_model_len}, expected {expected}")
else:
    print(f"PASS /v1/models max_model_len: {max_model_len}")

weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# The content is the call itself, so that the simulated engine (which echoes the user) returns
# it too; a real model must emit a call anyway under tool_choice "required".
content = (
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
)
raw = call("/v1/chat/completions", {
    "model": model,
    "messages": [{"role": "user", "content": content}],
    "tools": [weather],
    "tool_choice": "required",
    "thinking": {"type": "disabled"},
    "max_tokens": 256,
    "stream": True,
})
events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
chunks = [json.loads(e) for e in events if e != "[DONE]"]
deltas = [tc for c in chunks if c.get("choices") for tc in (c["choices"][0]["delta"].get("tool_calls") or [])]
names = [d["function"]["name"] for d in deltas if d.get("function", {}).get("name")]
arguments = "".join(d.get("function", {}).get("arguments") or "" for d in deltas)
try:
    parsed = json.loads(arguments) if arguments else None
except ValueError:
    parsed = None
finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")]
if events[-1:] != ["[DONE]"] or names[:1] != ["get_weather"] or not isinstance(parsed, dict) or finish != ["tool_calls"]:
    failures += 1
    print(f"FAIL streamed tool call: names={names} arguments={arguments!r} finish={finish}")
else:
    print(f"PASS streamed tool call: get_weather({arguments}), finish_reason tool_calls")
print(f"{2 - failures} passed, {failures} failed")
sys.exit(1 if failures else 0)
PY

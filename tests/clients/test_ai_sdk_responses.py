"""The Vercel AI SDK's default provider (`createOpenAI({baseURL})(model)`: the Responses API with
OpenAI's default `store: true`) against the live server: a 3-turn chat and a tool loop, whose
later requests refer to earlier output by `item_reference`, which the
server must resolve from what it stored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.clients.conftest import MODEL, NPM_PREFIX, Recorder, clean_env, marker, run_client
from tests.lanes import missing_lane

#: The tool loop's first request compiles the tools' grammar; on a cold server (this test alone)
#: on the 2-core machine under load that took up to 90 s (the compile workers' start-up).
pytestmark = [pytest.mark.clients, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).with_name("ai_sdk_responses.cjs")
PACKAGES = ("ai", "@ai-sdk/openai", "zod")


def _node() -> str:
    node = shutil.which("node")
    missing = [name for name in PACKAGES if not (NPM_PREFIX / "node_modules" / name).is_dir()]
    if node is None or missing:
        missing_lane(
            "clients",
            f"the AI SDK is not installed ({', '.join(missing) or 'node'} missing under "
            f"{NPM_PREFIX}; run scripts/install-test-clients.sh)",
        )
    return node


def _references(body: dict[str, object]) -> list[str]:
    items = body.get("input")
    assert isinstance(items, list)
    return [item["id"] for item in items if item.get("type") == "item_reference"]


def test_default_provider_chat_and_tool_loop(recorder: Recorder, tmp_path: Path) -> None:
    node = _node()
    word = marker()
    env = clean_env(tmp_path, NODE_PATH=str(NPM_PREFIX / "node_modules"))
    run = run_client(
        [node, str(SCRIPT), f"{recorder.base_url}/v1", MODEL, word], env, tmp_path, timeout=240
    )
    assert run.returncode == 0, run.describe(recorder)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for turn, text in zip(("one", "two", "three"), result["chat"], strict=True):
        assert f"Turn {turn} {word}" in text, run.describe(recorder)
    assert result["calls"] == [word], run.describe(recorder)
    assert f"sunny in {word}" in result["toolLoopText"], run.describe(recorder)
    assert result["steps"] == ["tool-calls", "stop"], run.describe(recorder)

    sent = recorder.to("/v1/responses")
    assert [exchange.status for exchange in sent] == [200] * 5, recorder.report()
    bodies = [exchange.json() for exchange in sent]
    assert all("store" not in body for body in bodies)  # OpenAI's default: stored
    # Turns 2 and 3 and the tool loop's second step name earlier output by reference only.
    assert _references(bodies[0]) == [] and _references(bodies[3]) == []
    for later in (bodies[1], bodies[2], bodies[4]):
        assert _references(later), recorder.report()
    assert any(item.get("type") == "function_call_output" for item in bodies[4]["input"])

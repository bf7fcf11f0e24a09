"""The Vercel AI SDK (Node): `createOpenAICompatible`'s `generateObject` against the server.

Without `supportsStructuredOutputs` (its default) the provider asks for `json_object` and sends
messages that need not mention JSON; OpenAI's rule (the word "json" in the messages) made that
a 400 here. The SDK runs from the npm prefix of `scripts/install-test-clients.sh`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.clients.conftest import MODEL, NPM_PREFIX, Recorder, clean_env, marker, run_client
from tests.lanes import missing_lane

# The first grammar compile starts the server's compile worker: tens of seconds on 2 busy cores.
pytestmark = [pytest.mark.clients, pytest.mark.timeout(300)]

NODE_MODULES = NPM_PREFIX / "node_modules"
SCRIPT = Path(__file__).with_name("ai_sdk_generate_object.cjs")


def generate_object(recorder: Recorder, tmp_path: Path, prompt: str, structured: bool) -> object:
    if not (NODE_MODULES / "@ai-sdk" / "openai-compatible").exists():
        missing_lane(
            "clients", f"the AI SDK is not in {NODE_MODULES} (run scripts/install-test-clients.sh)"
        )
    args = ["node", str(SCRIPT), f"{recorder.base_url}/v1", MODEL, prompt, str(structured).lower()]
    env = clean_env(tmp_path / "home", NODE_PATH=str(NODE_MODULES))
    run = run_client(args, env, tmp_path, timeout=240)
    assert run.returncode == 0, run.describe(recorder)
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("structured", [False, True], ids=["json_object", "json_schema"])
def test_generate_object(recorder: Recorder, tmp_path: Path, structured: bool) -> None:
    """The echo engine repeats the prompt, a JSON object the grammar allows."""
    word = marker()
    prompt = '{"city": "' + word + '"}'
    assert generate_object(recorder, tmp_path, prompt, structured) == {"city": word}
    (call,) = recorder.to("/v1/chat/completions")
    sent = call.json()
    kind = "json_schema" if structured else "json_object"
    assert sent["response_format"]["type"] == kind, recorder.report()
    if not structured:  # what OpenAI refuses: no message says "json"
        assert "json" not in json.dumps(sent["messages"]).lower()
        # ... and the schema is nowhere: not in response_format, not in a prompt of the SDK's.
        assert sent["response_format"] == {"type": "json_object"}, sent["response_format"]
        assert [m["role"] for m in sent["messages"]] == ["user"], sent["messages"]
        assert "string" not in json.dumps(sent["messages"]), sent["messages"]

"""OpenCode (`opencode run`) against the server's Chat Completions API, as a custom provider on
the AI SDK's openai-compatible package, its configuration the default apart from the base URL and
the model.

OpenCode asks `max_tokens: 32000` of a model it does not know, with a ~7k-token first prompt: on
the 32k window that fits only because the server lowers it to the room left (the default), and
every request is answered at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.clients.conftest import (
    MAX_MODEL_LEN,
    MODEL,
    Recorder,
    Run,
    clean_env,
    find_client,
    marker,
    run_client,
    sse_events,
)
from tests.dsml import tool_calls_block

pytestmark = pytest.mark.clients

#: What OpenCode asks of a model its catalogue does not describe.
DEFAULT_MAX_TOKENS = 32000


def opencode(recorder: Recorder, tmp_path: Path, prompt: str) -> tuple[Run, Path]:
    binary = find_client("opencode")
    workdir = tmp_path / "work"
    workdir.mkdir()
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "deepinfer": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "deepinfer",
                "options": {"baseURL": f"{recorder.base_url}/v1", "apiKey": "dummy-key"},
                "models": {MODEL: {"name": MODEL}},
            }
        },
        "model": f"deepinfer/{MODEL}",
    }
    (workdir / "opencode.json").write_text(json.dumps(config))
    # `opencode run` quotes an argument holding a space (and escapes its quotes): the words
    # are passed one by one, and it joins them with spaces into the prompt as written.
    run = run_client(
        [binary, "run", *prompt.split(" ")],
        clean_env(
            tmp_path / "home",
            # Offline: no models.dev catalogue, no update check.
            OPENCODE_DISABLE_MODELS_FETCH="1",
            OPENCODE_DISABLE_AUTOUPDATE="1",
        ),
        cwd=workdir,
        timeout=150,
    )
    return run, workdir


def usage(response_text: str) -> dict[str, Any]:
    """The usage of a streamed chat completion (OpenCode asks for it)."""
    for event in sse_events(response_text):
        if event.get("usage"):
            return dict(event["usage"])  # type: ignore[arg-type]
    raise AssertionError(f"no usage in the stream:\n{response_text[-2000:]}")


def check_served_at_once(recorder: Recorder) -> None:
    """Every chat request answered 200, the first time: none overflowed the window."""
    calls = recorder.to("/v1/chat/completions")
    assert calls, recorder.report()
    for call in calls:
        assert call.status == 200, call.summary()
        assert call.headers["authorization"] == "Bearer dummy-key"


@pytest.mark.timeout(180)
def test_plain_answer_on_default_flags(recorder: Recorder, tmp_path: Path) -> None:
    word = marker()
    run, _ = opencode(recorder, tmp_path, f"Please repeat {word}")

    assert run.returncode == 0, run.describe(recorder)
    assert word in run.stdout, run.describe(recorder)
    check_served_at_once(recorder)
    # The agent's turn (with its tools) asked more than its prompt leaves of the window.
    turn = next(c for c in recorder.to("/v1/chat/completions") if c.json().get("tools"))
    body = turn.json()
    assert body["max_tokens"] == DEFAULT_MAX_TOKENS and body["stream"] is True
    prompt_tokens = usage(turn.response_text)["prompt_tokens"]
    assert prompt_tokens + DEFAULT_MAX_TOKENS > MAX_MODEL_LEN, prompt_tokens


@pytest.mark.timeout(180)
def test_bash_tool_round_trip(recorder: Recorder, tmp_path: Path) -> None:
    word = marker()
    command = f"echo {word} > made.txt && echo {word}-ran"
    prompt = "Run this. " + tool_calls_block("bash", command=command, description="Write a file")
    run, workdir = opencode(recorder, tmp_path, prompt)

    assert run.returncode == 0, run.describe(recorder)
    assert (workdir / "made.txt").read_text().strip() == word, run.describe(recorder)
    # The next turn is the tool's result, which the echo engine hands back as the answer.
    assert f"{word}-ran" in run.stdout, run.describe(recorder)
    check_served_at_once(recorder)
    turns = [c for c in recorder.to("/v1/chat/completions") if c.json().get("tools")]
    assert len(turns) >= 2, recorder.report()
    messages = turns[-1].json()["messages"]
    called = next(m for m in messages if m["role"] == "assistant" and m.get("tool_calls"))
    result = next(m for m in messages if m["role"] == "tool")
    assert result["tool_call_id"] == called["tool_calls"][0]["id"]
    assert json.loads(called["tool_calls"][0]["function"]["arguments"])["command"] == command

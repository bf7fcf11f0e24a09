"""Claude Code (`claude -p`) against the server's Anthropic Messages API."""

from __future__ import annotations

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

# Claude Code's own default, beyond the room its prompt leaves: the lane keeps it, so that the
# server's lowering of it to that room is exercised.
DEFAULT_MAX_TOKENS = 32000


def claude(
    recorder: Recorder, tmp_path: Path, prompt: str, *flags: str, **env: str
) -> tuple[Run, Path]:
    binary = find_client("claude")
    workdir = tmp_path / "work"
    workdir.mkdir()
    run = run_client(
        [binary, "--model", MODEL, *flags, "-p", prompt],
        clean_env(
            tmp_path / "home",
            ANTHROPIC_BASE_URL=recorder.base_url,
            ANTHROPIC_API_KEY="dummy-key",
            DISABLE_TELEMETRY="1",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            DISABLE_AUTOUPDATER="1",
            **env,
        ),
        cwd=workdir,
    )
    return run, workdir


def message_usage(response_text: str) -> dict[str, Any]:
    for event in sse_events(response_text):
        if event.get("type") == "message_start":
            return dict(event["message"]["usage"])  # type: ignore[index]
    return {}


def prompt_tokens(usage: dict[str, Any]) -> int:
    """The prompt's tokens, as Anthropic splits them: Claude Code marks its prompt with
    `cache_control`, so what the cache writes or reads is not in `input_tokens`."""
    created = usage.get("cache_creation_input_tokens") or 0
    return int(usage["input_tokens"] + created + (usage.get("cache_read_input_tokens") or 0))


def check_served_at_once(recorder: Recorder) -> None:
    """Every request Claude Code made was answered the first time: no 400 (a context overflow
    would make it retry with a smaller max_tokens, one more round trip per turn), its
    `HEAD /` probe included. A max_tokens beyond the room its prompt leaves is lowered to it
    (the server's default), so the answer's usage and the output fit the window."""
    calls = recorder.to("/v1/messages")
    assert calls, recorder.report()
    for exchange in recorder.exchanges:
        assert exchange.status == 200, f"a request was refused: {exchange.summary()}"
    for call in calls:
        assert call.query == "beta=true", call.target
        usage = message_usage(call.response_text)
        assert prompt_tokens(usage) < MAX_MODEL_LEN, usage


@pytest.mark.timeout(120)
def test_plain_answer(recorder: Recorder, tmp_path: Path) -> None:
    word = marker()
    run, _ = claude(recorder, tmp_path, f"Please repeat {word}")

    assert run.returncode == 0, run.describe(recorder)
    assert word in run.stdout, run.describe(recorder)
    calls = recorder.to("/v1/messages")
    first = calls[0]
    body = first.json()
    assert body["max_tokens"] == DEFAULT_MAX_TOKENS
    assert body["stream"] is True
    assert first.headers["anthropic-version"] == "2023-06-01"
    assert first.headers["x-api-key"] == "dummy-key"
    check_served_at_once(recorder)


def run_bash_round_trip(recorder: Recorder, tmp_path: Path, **env: str) -> None:
    word = marker()
    made = tmp_path / "work" / "made.txt"
    command = f"echo {word} > {made} && echo {word}-ran"
    prompt = "Run this. " + tool_calls_block("Bash", command=command, description="Write a file")
    run, _ = claude(recorder, tmp_path, prompt, "--allowedTools", "Bash", **env)

    assert run.returncode == 0, run.describe(recorder)
    assert made.read_text().strip() == word, run.describe(recorder)  # the tool really ran
    # The second turn is the tool result, which the echo engine hands back as the answer.
    assert f"{word}-ran" in run.stdout, run.describe(recorder)

    answered = [call for call in recorder.to("/v1/messages") if call.status == 200]
    assert len(answered) >= 2, recorder.report()
    first, second = answered[0], answered[-1]
    bash_tool = next(tool for tool in first.json()["tools"] if tool["name"] == "Bash")
    assert bash_tool.get("type") in (None, "custom"), bash_tool
    tool_use = next(
        event["content_block"]
        for event in sse_events(first.response_text)
        if event.get("type") == "content_block_start"
        and event["content_block"]["type"] == "tool_use"  # type: ignore[index]
    )
    messages = second.json()["messages"]
    replayed = [block for block in messages[-2]["content"] if block["type"] == "tool_use"]
    assert replayed and replayed[0]["id"] == tool_use["id"], messages[-2]  # type: ignore[index]
    assert replayed[0]["input"]["command"] == command
    result = messages[-1]["content"][0]
    assert result["type"] == "tool_result" and result["tool_use_id"] == tool_use["id"]  # type: ignore[index]
    assert f"{word}-ran" in str(result["content"])
    check_served_at_once(recorder)


@pytest.mark.timeout(120)
def test_bash_tool_round_trip(recorder: Recorder, tmp_path: Path) -> None:
    """Default settings: the first request asks max_tokens 32000 with a ~12k-token prompt."""
    run_bash_round_trip(recorder, tmp_path)
    first = next(c for c in recorder.to("/v1/messages") if c.json().get("tools"))
    asked = first.json()["max_tokens"]
    assert prompt_tokens(message_usage(first.response_text)) + asked > MAX_MODEL_LEN


@pytest.mark.timeout(120)
def test_bash_tool_round_trip_with_capped_output(recorder: Recorder, tmp_path: Path) -> None:
    """The same round trip with CLAUDE_CODE_MAX_OUTPUT_TOKENS, which fits the 32k context."""
    run_bash_round_trip(recorder, tmp_path, CLAUDE_CODE_MAX_OUTPUT_TOKENS="8000")

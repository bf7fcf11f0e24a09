"""Qwen Code (`qwen -p`) against the server's Chat Completions API, configured only by its
environment's base URL, key and model (its OpenAI-compatible default).

Qwen Code 0.15.10 asks `max_tokens: 8000` of a model it does not know, which fits the 32k window
next to its ~15k-token first prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

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

#: What Qwen Code 0.15.10 asks of a model it does not know.
DEFAULT_MAX_TOKENS = 8000


def qwen(recorder: Recorder, tmp_path: Path, prompt: str, *flags: str) -> tuple[Run, Path]:
    binary = find_client("qwen")
    workdir = tmp_path / "work"
    workdir.mkdir()
    (tmp_path / "home").mkdir()  # Qwen Code reads its settings under a HOME that exists
    run = run_client(
        [binary, *flags, "-p", prompt],
        clean_env(
            tmp_path / "home",
            OPENAI_BASE_URL=f"{recorder.base_url}/v1",
            OPENAI_API_KEY="dummy-key",
            OPENAI_MODEL=MODEL,
        ),
        cwd=workdir,
        timeout=150,
    )
    return run, workdir


def check_requests(recorder: Recorder) -> None:
    """Every chat request answered 200 the first time, with Qwen Code's output limit, within
    the window."""
    calls = recorder.to("/v1/chat/completions")
    assert calls, recorder.report()
    for call in calls:
        assert call.status == 200, call.summary()
        assert call.headers["authorization"] == "Bearer dummy-key"
        body = call.json()
        assert body["max_tokens"] == DEFAULT_MAX_TOKENS, body.get("max_tokens")
        for event in sse_events(call.response_text):
            if event.get("usage"):
                prompt = event["usage"]["prompt_tokens"]  # type: ignore[index]
                assert prompt + DEFAULT_MAX_TOKENS <= MAX_MODEL_LEN, prompt


@pytest.mark.timeout(180)
def test_plain_answer(recorder: Recorder, tmp_path: Path) -> None:
    word = marker()
    run, _ = qwen(recorder, tmp_path, f"Please repeat {word}")

    assert run.returncode == 0, run.describe(recorder)
    assert word in run.stdout, run.describe(recorder)
    check_requests(recorder)


@pytest.mark.timeout(180)
def test_shell_tool_round_trip(recorder: Recorder, tmp_path: Path) -> None:
    """Non-interactive Qwen Code runs a shell command only in its yolo approval mode."""
    word = marker()
    command = f"echo {word} > made.txt && echo {word}-ran"
    call = tool_calls_block("run_shell_command", command=command, description="Write a file")
    run, workdir = qwen(recorder, tmp_path, "Run this. " + call, "--approval-mode", "yolo")

    assert run.returncode == 0, run.describe(recorder)
    assert (workdir / "made.txt").read_text().strip() == word, run.describe(recorder)
    assert f"{word}-ran" in run.stdout, run.describe(recorder)
    check_requests(recorder)
    messages = recorder.to("/v1/chat/completions")[-1].json()["messages"]
    called = next(m for m in messages if m["role"] == "assistant" and m.get("tool_calls"))
    result = next(m for m in messages if m["role"] == "tool")
    assert result["tool_call_id"] == called["tool_calls"][0]["id"]
    assert json.loads(called["tool_calls"][0]["function"]["arguments"])["command"] == command

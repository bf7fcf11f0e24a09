"""Codex CLI (`codex exec`) against the server's Responses API, as a custom provider."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deepinfer_server.protocol.core.reasoning_seal import ReasoningSeal
from deepinfer_server.protocol.responses.reasoning import conversation_digest
from tests.clients.conftest import (
    MODEL,
    REASONING_SECRET,
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

CONFIG = """\
model = "{model}"
model_provider = "deepinfer"
check_for_update_on_startup = false

[model_providers.deepinfer]
name = "deepinfer"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "DEEPINFER_TEST_KEY"

[analytics]
enabled = false
"""


def codex(recorder: Recorder, tmp_path: Path, prompt: str, *flags: str) -> tuple[Run, Path, Path]:
    binary = find_client("codex")
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(CONFIG.format(model=MODEL, base_url=recorder.base_url))
    workdir = tmp_path / "work"
    workdir.mkdir()
    last_message = tmp_path / "last-message.txt"
    run = run_client(
        [binary, "exec", "--skip-git-repo-check", "-o", str(last_message), *flags, prompt],
        clean_env(tmp_path / "home", CODEX_HOME=str(codex_home), DEEPINFER_TEST_KEY="dummy-key"),
        cwd=workdir,
    )
    return run, workdir, last_message


def output_items(response_text: str) -> list[dict[str, Any]]:
    """The `output` of the stream's response.completed event."""
    for event in sse_events(response_text):
        if event.get("type") == "response.completed":
            return list(event["response"]["output"])  # type: ignore[index]
    raise AssertionError(f"no response.completed in the stream:\n{response_text[-2000:]}")


def check_request_shape(recorder: Recorder) -> None:
    """What Codex sends on every turn (and the server must accept)."""
    calls = recorder.to("/v1/responses")
    assert calls, recorder.report()
    for call in calls:
        assert call.status == 200, call.summary()
        assert call.headers["authorization"] == "Bearer dummy-key"
        body = call.json()
        assert body["stream"] is True and body["store"] is False
        assert body["include"] == ["reasoning.encrypted_content"]
        assert body["reasoning"].get("summary") == "auto"
        assert body["input"][0]["role"] == "developer"
        # As asked: every reasoning item carries its reasoning sealed by the server's key, and
        # a summary.
        # Each is sealed after the conversation before it: the input, then earlier output.
        seal = ReasoningSeal.from_secret(REASONING_SECRET)
        produced = output_items(call.response_text)
        for index, item in enumerate(produced):
            if item["type"] == "reasoning":
                text = "".join(part["text"] for part in item["content"])
                assert text, item
                context = conversation_digest([*body["input"], *produced[:index]])
                assert seal.open(item["encrypted_content"], context) == text, item
                assert item["summary"] == [{"type": "summary_text", "text": text}], item


@pytest.mark.timeout(120)
def test_plain_answer(recorder: Recorder, tmp_path: Path) -> None:
    word = marker()
    run, _, last_message = codex(recorder, tmp_path, f"Please repeat {word}")

    assert run.returncode == 0, run.describe(recorder)
    assert word in last_message.read_text(), run.describe(recorder)
    assert word in run.stdout
    check_request_shape(recorder)


@pytest.mark.timeout(120)
def test_exec_command_round_trip(recorder: Recorder, tmp_path: Path) -> None:
    word = marker()
    command = f"echo {word} > made.txt && echo {word}-ran"
    prompt = "Run this. " + tool_calls_block("exec_command", cmd=command)
    run, workdir, last_message = codex(recorder, tmp_path, prompt, "--sandbox", "workspace-write")

    assert run.returncode == 0, run.describe(recorder)
    assert (workdir / "made.txt").read_text().strip() == word, run.describe(recorder)
    assert f"{word}-ran" in last_message.read_text(), run.describe(recorder)
    check_request_shape(recorder)

    calls = recorder.to("/v1/responses")
    assert len(calls) >= 2, recorder.report()
    first, second = calls[0], calls[-1]
    tools = {tool.get("name"): tool for tool in first.json()["tools"]}
    assert tools["exec_command"]["type"] == "function"
    produced = output_items(first.response_text)
    call = next(item for item in produced if item["type"] == "function_call")
    assert call["name"] == "exec_command"
    assert json.loads(call["arguments"]) == {"cmd": command}

    # The next turn replays the whole history: the reasoning item verbatim, the call, its output.
    replay = second.json()["input"]
    reasoning = next(item for item in produced if item["type"] == "reasoning")
    replayed_reasoning = [item for item in replay if item.get("type") == "reasoning"]
    assert replayed_reasoning, replay
    assert replayed_reasoning[-1]["encrypted_content"] == reasoning["encrypted_content"]
    # Codex's history before the reasoning item is the conversation it was sealed after, so
    # the blob verifies where Codex replays it (and its reasoning reaches the prompt).
    where = replay.index(replayed_reasoning[-1])
    seal = ReasoningSeal.from_secret(REASONING_SECRET)
    opened = seal.open(reasoning["encrypted_content"], conversation_digest(replay[:where]))
    assert opened == "".join(part["text"] for part in reasoning["content"]), replay[:where]
    replayed_call = next(item for item in replay if item.get("type") == "function_call")
    assert replayed_call["call_id"] == call["call_id"]
    output = next(item for item in replay if item.get("type") == "function_call_output")
    assert output["call_id"] == call["call_id"]
    assert f"{word}-ran" in output["output"]

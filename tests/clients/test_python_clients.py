"""Python clients and SDK calls: LiteLLM (openai/ and anthropic/ routes), LangChain's ChatOpenAI,
the Anthropic SDK's tool runner, count_tokens and models.retrieve, the openai SDK's
models.retrieve."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import openai
import pytest
from anthropic.lib.tools import beta_tool

from tests.clients.conftest import MAX_MODEL_LEN, MODEL, Recorder, live_server, marker
from tests.dsml import WEATHER_TOOL, tool_calls_block
from tests.lanes import import_lane

pytestmark = [
    pytest.mark.clients,
    pytest.mark.timeout(60),
    # The client libraries' own import-time warnings are theirs, not the server's.
    pytest.mark.filterwarnings("ignore::UserWarning:pydantic.*"),
]

ANTHROPIC_WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": WEATHER_TOOL["function"]["parameters"],  # type: ignore[index]
}


T = TypeVar("T")


def checked(recorder: Recorder, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run one client call; if it raises, fail with what the server was sent and answered."""
    try:
        return call(*args, **kwargs)
    except Exception as exc:
        raise AssertionError(
            f"{type(exc).__name__}: {exc}\n--- requests\n{recorder.report()}"
        ) from exc


def weather_call(city: str) -> str:
    return "Call the tool. " + tool_calls_block("get_weather", city=city)


@pytest.fixture()
def openai_client(recorder: Recorder) -> Iterator[openai.OpenAI]:
    url = f"{recorder.base_url}/v1"
    with openai.OpenAI(base_url=url, api_key="dummy-key", max_retries=0) as client:
        yield client


@pytest.fixture()
def anthropic_client(recorder: Recorder) -> Iterator[anthropic.Anthropic]:
    url = recorder.base_url
    with anthropic.Anthropic(base_url=url, api_key="dummy-key", max_retries=0) as client:
        yield client


def litellm() -> Any:
    # Offline: the bundled model cost map instead of fetching one from the internet.
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    module = import_lane("clients", "litellm", "run scripts/install-test-clients.sh")
    module.telemetry = False
    return module


# --- LiteLLM ---------------------------------------------------------------------------------


def test_litellm_openai_route(recorder: Recorder) -> None:
    llm = litellm()
    word = marker()
    common: dict[str, Any] = dict(
        model=f"openai/{MODEL}", api_base=f"{recorder.base_url}/v1", api_key="dummy-key"
    )
    answer = checked(
        recorder,
        llm.completion,
        messages=[{"role": "user", "content": word}],
        max_tokens=64,
        **common,
    )
    assert word in answer.choices[0].message.content, recorder.report()

    called = checked(
        recorder,
        llm.completion,
        messages=[{"role": "user", "content": weather_call(word)}],
        tools=[WEATHER_TOOL],
        max_tokens=256,
        **common,
    )
    tool_call = called.choices[0].message.tool_calls[0]
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": word}
    assert called.choices[0].finish_reason == "tool_calls"
    chat = recorder.to("/v1/chat/completions")
    assert [call.status for call in chat] == [200, 200], recorder.report()
    assert chat[1].json()["tools"][0]["type"] == "function"


def test_litellm_batch_api(recorder: Recorder, tmp_path: Path) -> None:
    """LiteLLM's files and batches API (its openai provider) unchanged against the server."""
    llm = litellm()
    word = marker()
    common: dict[str, Any] = dict(
        custom_llm_provider="openai", api_base=f"{recorder.base_url}/v1", api_key="dummy-key"
    )
    path = tmp_path / "batch.jsonl"
    line = {
        "custom_id": "only",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": word}], "max_tokens": 64},
    }
    path.write_text(json.dumps(line) + "\n")
    with path.open("rb") as file:
        uploaded = checked(recorder, llm.create_file, file=file, purpose="batch", **common)
    batch = checked(
        recorder,
        llm.create_batch,
        completion_window="24h",
        endpoint="/v1/chat/completions",
        input_file_id=uploaded.id,
        **common,
    )
    deadline = time.monotonic() + 30
    while batch.status != "completed" and time.monotonic() < deadline:
        time.sleep(0.1)  # polling, as LiteLLM's users do
        batch = checked(recorder, llm.retrieve_batch, batch_id=batch.id, **common)
    assert batch.status == "completed", recorder.report()
    content = checked(recorder, llm.file_content, file_id=batch.output_file_id, **common)
    (answer,) = [json.loads(text) for text in content.text.splitlines()]
    assert answer["custom_id"] == "only" and answer["response"]["status_code"] == 200
    assert word in answer["response"]["body"]["choices"][0]["message"]["content"]


def test_litellm_anthropic_route_custom_tools(recorder: Recorder) -> None:
    """LiteLLM's anthropic/ route marks every tool `"type": "custom"`."""
    llm = litellm()
    word = marker()
    called = checked(
        recorder,
        llm.completion,
        model=f"anthropic/{MODEL}",
        api_base=recorder.base_url,
        api_key="dummy-key",
        messages=[{"role": "user", "content": weather_call(word)}],
        tools=[WEATHER_TOOL],
        max_tokens=256,
    )
    messages = recorder.to("/v1/messages")
    assert messages, recorder.report()
    sent_tools = messages[-1].json()["tools"]
    assert sent_tools[0]["name"] == "get_weather"
    assert sent_tools[0].get("type") == "custom", sent_tools[0]
    assert messages[-1].status == 200, recorder.report()
    tool_call = called.choices[0].message.tool_calls[0]
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": word}


# --- LangChain -------------------------------------------------------------------------------


def chat_openai(recorder: Recorder) -> Any:
    langchain_openai = import_lane(
        "clients", "langchain_openai", "run scripts/install-test-clients.sh"
    )
    return langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=f"{recorder.base_url}/v1",
        api_key="dummy-key",
        max_retries=0,
        max_tokens=256,
    )


def test_langchain_stream(recorder: Recorder) -> None:
    llm = chat_openai(recorder)
    word = marker()
    chunks = checked(recorder, lambda: list(llm.stream(f"Please repeat {word}")))
    assert len(chunks) > 1  # streamed, not one piece
    text = "".join(str(chunk.content) for chunk in chunks)
    assert word in text, recorder.report()
    (call,) = recorder.to("/v1/chat/completions")
    assert call.status == 200 and call.json()["stream"] is True


def test_langchain_bind_tools(recorder: Recorder) -> None:
    llm = chat_openai(recorder)
    word = marker()

    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return "sunny"

    message = checked(recorder, llm.bind_tools([get_weather]).invoke, weather_call(word))
    assert message.tool_calls, recorder.report()
    assert message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"] == {"city": word}
    (call,) = recorder.to("/v1/chat/completions")
    assert call.json()["tools"][0]["function"]["name"] == "get_weather"


def test_langchain_context_overflow(recorder: Recorder) -> None:
    """An overflow reaches LangChain with OpenAI's code, which overflow handling keys on.

    (langchain-openai 1.7 looks for the code in the exception's text, which openai 3.x limits to
    the message: the code is checked on the exception's body instead.)"""
    llm = chat_openai(recorder)
    with pytest.raises(openai.BadRequestError) as raised:
        # A max_tokens past the room left is lowered to it by default: a prompt that alone
        # exceeds the window is what still overflows.
        llm.invoke("word " * (MAX_MODEL_LEN + 1000))
    assert raised.value.code == "context_length_exceeded", recorder.report()
    (call,) = recorder.to("/v1/chat/completions")
    assert call.status == 400


# --- SDK calls beyond generation -------------------------------------------------------------


def test_anthropic_tool_runner(recorder: Recorder, anthropic_client: anthropic.Anthropic) -> None:
    """`beta.messages.tool_runner` with its default arguments completes a tool loop: it asks for
    a message thread, is refused with `thread_unsupported_request`, and goes on without one."""
    word = marker()
    calls: list[str] = []

    @beta_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(city)
        return f"sunny in {city}"

    runner = anthropic_client.beta.messages.tool_runner(
        model=MODEL,
        max_tokens=256,
        messages=[{"role": "user", "content": weather_call(word)}],
        tools=[get_weather],
    )
    final = checked(recorder, runner.until_done)
    assert calls == [word], recorder.report()
    # The echo engine repeats the last user turn: the tool result.
    assert f"sunny in {word}" in "".join(b.text for b in final.content if b.type == "text")
    turns = recorder.to("/v1/messages")
    assert [turn.status for turn in turns] == [400, 200, 200], recorder.report()
    assert turns[0].json()["thread"] == {"type": "create"}
    assert [len(turn.json()["messages"]) for turn in turns[1:]] == [1, 3]


def test_anthropic_count_tokens(recorder: Recorder, anthropic_client: anthropic.Anthropic) -> None:
    client = anthropic_client
    counted = checked(
        recorder,
        client.messages.count_tokens,
        model=MODEL,
        system="You are terse.",
        messages=[{"role": "user", "content": "How many tokens is this?"}],
        tools=[ANTHROPIC_WEATHER_TOOL],  # type: ignore[list-item]
    )
    (call,) = recorder.to("/v1/messages/count_tokens")
    assert call.status == 200, call.summary()
    assert counted.input_tokens > 0
    bare = checked(
        recorder,
        client.messages.count_tokens,
        model=MODEL,
        messages=[{"role": "user", "content": "How many tokens is this?"}],
    )
    assert 0 < bare.input_tokens < counted.input_tokens  # the system prompt and tools count
    answer = checked(
        recorder,
        client.messages.create,
        model=MODEL,
        max_tokens=64,
        system="You are terse.",
        messages=[{"role": "user", "content": "How many tokens is this?"}],
        tools=[ANTHROPIC_WEATHER_TOOL],  # type: ignore[list-item]
    )
    assert answer.usage.input_tokens == counted.input_tokens  # exactly what /v1/messages encodes


def test_anthropic_models_retrieve(
    recorder: Recorder, anthropic_client: anthropic.Anthropic
) -> None:
    model = checked(recorder, anthropic_client.models.retrieve, MODEL)
    assert model.id == MODEL, recorder.report()
    assert model.type == "model"
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.models.retrieve("no-such-model")


def test_openai_models_retrieve(recorder: Recorder, openai_client: openai.OpenAI) -> None:
    model = checked(recorder, openai_client.models.retrieve, MODEL)
    assert model.id == MODEL, recorder.report()
    assert model.object == "model"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("no-such-model")


def test_openai_developer_role(recorder: Recorder, openai_client: openai.OpenAI) -> None:
    """The `developer` role (pydantic-ai, the Vercel AI SDK, Codex) is a system message."""
    word = marker()
    completion = checked(
        recorder,
        openai_client.chat.completions.create,
        model=MODEL,
        messages=[
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": word},
        ],
        max_tokens=64,
    )
    assert word in (completion.choices[0].message.content or ""), recorder.report()


# --- Several served names --------------------------------------------------------------------

ALIASES = (MODEL, "deepseek-v4.1-flash", "claude-sonnet-local")


@pytest.mark.timeout(120)
def test_several_served_names(server_args: list[str]) -> None:
    """`--served-model-name a b c`: every name is listed and answers (its own server); the first
    is the one responses report."""
    with live_server(*server_args, "--served-model-name", *ALIASES) as server:
        check_aliases(server.base_url)


def check_aliases(base_url: str) -> None:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="dummy", max_retries=0) as client:
        assert [model.id for model in client.models.list()] == list(ALIASES)
        for name in ALIASES:
            word = marker()
            completion = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": word}], max_tokens=64
            )
            assert word in (completion.choices[0].message.content or "")
            assert completion.model == ALIASES[0]
    with anthropic.Anthropic(base_url=base_url, api_key="dummy", max_retries=0) as claude:
        answer = claude.messages.create(
            model=ALIASES[2], max_tokens=64, messages=[{"role": "user", "content": "alias"}]
        )
        assert answer.model == ALIASES[0]

"""The HTTP layer in-process (httpx's ASGI transport) against a scripted fake coordinator."""

from __future__ import annotations

import logging

import orjson
import pytest

from deepinfer_server.errors import EngineRequestError, ErrorKind, OverloadedError
from deepinfer_server.ipc.messages import AbortReason, Finish
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from tests.dsml import WEATHER_TOOL, tool_calls_block
from tests.http.harness import MODEL, Script, failures, run, serve

CHAT = "/v1/chat/completions"


def chat_body(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def sse_data(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_chat_json_answer_carries_the_request_id() -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.post(
                CHAT, json=chat_body(), headers={"X-Request-Id": "abc-1"}
            )
            assert response.status_code == 200
            assert response.headers["x-request-id"] == "abc-1"
            message = response.json()["choices"][0]["message"]
            assert message["content"] == "Hello from the fake engine"
            assert message["reasoning_content"] == "Thinking."
            assert h.coordinator.closed and h.coordinator.closed[0][1] is False  # not aborted

    run(body)


def test_chat_stream_frames_and_done() -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.post(CHAT, json=chat_body(stream=True))
            frames = sse_data(response.text)
            assert frames[-1] == "[DONE]"
            chunks = [orjson.loads(f) for f in frames[:-1]]
            content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            assert content == "Hello from the fake engine"
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    run(body)


def test_an_unexpected_exception_is_a_500_with_the_request_id_and_logged_with_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body() -> None:
        async with serve() as h:
            h.coordinator.submit_error = RuntimeError("a bug")
            with caplog.at_level(logging.ERROR):
                response = await h.client.post(
                    CHAT, json=chat_body(), headers={"X-Request-Id": "bug-7"}
                )
            assert response.status_code == 500
            assert response.headers["x-request-id"] == "bug-7"
            assert response.json()["error"] == {
                "message": "internal server error",
                "type": "server_error",
                "param": None,
                "code": "internal_error",
            }
            assert any("bug-7" in r.getMessage() for r in caplog.records)
            assert failures(h.metrics) == {"500": 1.0}

    run(body)


@pytest.mark.parametrize(
    ("path", "payload", "envelope"),
    [
        (CHAT, chat_body(), "openai"),
        (
            "/v1/messages",
            {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
            "anthropic",
        ),
    ],
)
def test_overload_is_429_in_the_protocols_envelope(
    path: str, payload: dict[str, object], envelope: str
) -> None:
    async def body() -> None:
        async with serve() as h:
            h.coordinator.submit_error = OverloadedError("full")
            response = await h.client.post(path, json=payload)
            assert response.status_code == 429
            assert response.headers["retry-after"] == "1"
            data = response.json()
            if envelope == "openai":
                assert data["error"]["type"] == "rate_limit_exceeded"
                assert data["error"]["code"] == "rate_limit_exceeded"
            else:
                assert data == {
                    "type": "error",
                    "error": {"type": "rate_limit_error", "message": "full"},
                }
            assert failures(h.metrics) == {"429": 1.0}

    run(body)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"model": "nope"}, "model"),
    ],
)
def test_bad_requests_name_the_param(extra: dict[str, object], param: str) -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.post(CHAT, json=chat_body(**extra))
            assert response.status_code in (400, 404)
            assert response.json()["error"]["param"] == param
            assert not h.coordinator.submitted

    run(body)


def test_context_overflow_has_openais_code() -> None:
    async def body() -> None:
        async with serve("--no-clamp-max-tokens") as h:
            response = await h.client.post(CHAT, json=chat_body(max_tokens=10_000))
            assert response.status_code == 400
            assert response.json()["error"]["code"] == "context_length_exceeded"

    run(body)


def test_engine_error_mid_stream_ends_responses_with_an_error_event() -> None:
    error = EngineRequestError("grammar failed", kind=ErrorKind.ENGINE_GRAMMAR_FAILED)
    script = Script(finish=None, error=error)

    async def body() -> None:
        async with serve(script=script) as h:
            response = await h.client.post(
                "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}
            )
            assert response.status_code == 200
            events = [orjson.loads(d) for d in sse_data(response.text)]
            assert events[-1]["type"] == "error"
            assert events[-1]["code"] == "structured_output_failed"
            assert failures(h.metrics) == {"500": 1.0}

    run(body)


def test_a_stop_sequence_aborts_the_engine_request() -> None:
    async def body() -> None:
        async with serve(script=Script(text="alpha beta gamma", finish=None, hold=False)) as h:
            response = await h.client.post(
                CHAT, json=chat_body(stop=["beta"], thinking={"type": "disabled"})
            )
            assert response.json()["choices"][0]["message"]["content"] == "alpha "
            assert h.coordinator.closed == [(h.coordinator.submitted[0][0], True, AbortReason.STOP)]

    run(body)


def test_api_key_rejection_speaks_each_protocols_way() -> None:
    async def body() -> None:
        async with serve("--api-key", "k") as h:
            chat = await h.client.post(CHAT, json=chat_body())
            assert chat.status_code == 401 and "Bearer" in chat.json()["error"]["message"]
            messages = await h.client.post("/v1/messages", json={})
            assert messages.status_code == 401
            assert messages.json()["error"]["type"] == "authentication_error"
            assert "x-api-key" in messages.json()["error"]["message"]
            # Anyone can send requests without a key: they are not failures of the service.
            assert failures(h.metrics) == {}
            ok = await h.client.post(CHAT, json=chat_body(), headers={"x-api-key": "k"})
            assert ok.status_code == 200

    run(body)


def test_unknown_route_and_method_are_json() -> None:
    async def body() -> None:
        async with serve() as h:
            missing = await h.client.get("/v1/nothing")
            assert missing.status_code == 404
            assert missing.json()["error"]["code"] == "not_found"
            wrong = await h.client.get(CHAT)
            assert wrong.status_code == 405
            assert wrong.json()["error"]["code"] == "method_not_allowed"

    run(body)


def test_health_reports_failure_and_drain_without_counting_failures() -> None:
    async def body() -> None:
        async with serve() as h:
            assert (await h.client.get("/health")).json() == {"status": "ok"}
            h.coordinator.draining = True
            assert (await h.client.get("/health")).status_code == 503
            h.coordinator.failure = "rank 0 died"
            failed = await h.client.get("/health")
            assert failed.json() == {"status": "failed", "reason": "rank 0 died"}
            assert failures(h.metrics) == {}

    run(body)


def test_finish_length_reaches_the_client() -> None:
    async def body() -> None:
        async with serve(script=Script(finish=Finish.LENGTH)) as h:
            response = await h.client.post(CHAT, json=chat_body())
            assert response.json()["choices"][0]["finish_reason"] == "length"

    run(body)


def test_structured_output_without_xgrammar_is_a_clear_400_but_strict_tools_still_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from deepinfer_server.protocol.core import structured_outputs

    monkeypatch.setattr(structured_outputs, "xgrammar_installed", lambda: False)

    async def body() -> None:
        tokenizer_json = embedded_tokenizer_json()
        async with serve(structured=structured_outputs.StructuredOutputs(tokenizer_json)) as h:
            response = await h.client.post(
                CHAT,
                json=chat_body(
                    response_format={"type": "json_object"},
                    messages=[{"role": "user", "content": "json please"}],
                ),
            )
            assert response.status_code == 400
            assert (
                "pip install '.[grammar]' in the deepinfer-server checkout"
                in (response.json()["error"]["message"])
            )
            assert response.json()["error"]["code"] == "unsupported_parameter"
            strict_tool = {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object"}, "strict": True},
            }
            ok = await h.client.post(CHAT, json=chat_body(tools=[strict_tool]))
            assert ok.status_code == 200
            assert h.coordinator.submitted[-1][2].structured is None
            no_thinking = {"thinking": {"type": "disabled"}}
            forced = chat_body(tools=[strict_tool], tool_choice="required", **no_thinking)
            assert (await h.client.post(CHAT, json=forced)).status_code == 200
            forced_thinking = chat_body(tools=[strict_tool], tool_choice="required")
            refused = await h.client.post(CHAT, json=forced_thinking)
            assert refused.status_code == 400
            assert refused.json()["error"]["code"] == "unsupported_parameter"

    run(body)


def test_a_stream_that_fails_midway_is_logged_with_its_outcome(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error = EngineRequestError("out of KV cache", kind=ErrorKind.ENGINE_OUT_OF_RESOURCES)

    async def body() -> None:
        async with serve(script=Script(finish=None, error=error)) as h:
            with caplog.at_level(logging.INFO):
                response = await h.client.post(
                    CHAT, json=chat_body(stream=True), headers={"X-Request-Id": "mid-1"}
                )
            assert response.status_code == 200
            access = [r.getMessage() for r in caplog.records if r.name.endswith("access")]
            assert any(
                "request_id=mid-1" in line and "error=engine_out_of_resources" in line
                for line in access
            )
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert any("mid-1" in r.getMessage() for r in warnings)

    run(body)


@pytest.mark.parametrize("forged", ["%0a", "%0d", "%1b[2J", "%0d%0a", "%e2%80%a8", "%20"])
def test_the_access_log_escapes_what_could_forge_a_line(
    forged: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        async with serve() as h:
            path = f"/v1/models{forged}GET%20/v1/models%20200%20request_id=forged"
            with caplog.at_level(logging.INFO, logger="deepinfer_server.access"):
                response = await h.client.get(path, headers={"X-Request-Id": "real-1"})
            assert response.status_code == 404
            (line,) = [r.getMessage() for r in caplog.records if r.name.endswith("access")]
            assert line.isprintable(), line
            assert line.split(" ")[1].startswith("/v1/models\\x") or forged == "%e2%80%a8"
            assert line.split(" ")[2] == "404" and "request_id=real-1" in line

    run(body)


_CALL = tool_calls_block("get_weather", city="Paris")
_TOOLS_OPENAI = [WEATHER_TOOL]
_TOOLS_ANTHROPIC = [
    {
        "name": "get_weather",
        "description": "Current weather of a city",
        "input_schema": WEATHER_TOOL["function"]["parameters"],  # type: ignore[index]
    }
]
_RESPONSES_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
]


@pytest.mark.parametrize(
    ("path", "request_body", "text", "finish", "logged"),
    [
        (CHAT, chat_body(tools=_TOOLS_OPENAI), _CALL, Finish.STOP, "tool_calls"),
        (CHAT, chat_body(), "fine", Finish.LENGTH, "length"),
        (CHAT, chat_body(stream=True, tools=_TOOLS_OPENAI), _CALL, Finish.STOP, "tool_calls"),
        (
            "/v1/messages",
            {"model": MODEL, "max_tokens": 64, "tools": _TOOLS_ANTHROPIC,
             "messages": [{"role": "user", "content": "hi"}]},
            _CALL, Finish.STOP, "tool_use",
        ),
        (
            "/v1/messages",
            {"model": MODEL, "max_tokens": 64, "stream": True,
             "messages": [{"role": "user", "content": "hi"}]},
            "fine", Finish.STOP, "end_turn",
        ),
        ("/v1/responses", {"model": MODEL, "input": "hi"}, "fine", Finish.STOP, "completed"),
        (
            "/v1/responses",
            {"model": MODEL, "input": "hi", "stream": True},
            "fine", Finish.LENGTH, "max_output_tokens",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi"},
            "fine", Finish.LENGTH, "length",
        ),
    ],
)  # fmt: skip
def test_the_access_log_records_the_finish_reason_the_client_saw(
    path: str,
    request_body: dict[str, object],
    text: str,
    finish: Finish,
    logged: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body() -> None:
        async with serve(script=Script(text=text, finish=finish)) as h:
            with caplog.at_level(logging.INFO, logger="deepinfer_server.access"):
                response = await h.client.post(
                    path, json=request_body, headers={"X-Request-Id": "fin-1"}
                )
            assert response.status_code == 200, response.text
            assert logged in response.text  # what the client saw ...
            (line,) = [r.getMessage() for r in caplog.records if r.name.endswith("access")]
            assert f"finish_reason={logged} " in f"{line} "  # ... is what the log says

    run(body)

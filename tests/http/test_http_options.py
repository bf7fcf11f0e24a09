"""The HTTP layer's options in-process: API keys, CORS, the access log and `--log-requests`,
request IDs, `--max-request-bytes`, /version (moved from tests/e2e/test_operations.py: none of
them needs a real process; the body-read timeout against a dripping socket stays there)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import openai
import orjson
import pytest

from tests.http.harness import MODEL, failures, run, serve
from tests.metrics_scrape import parse_metrics, value

CHAT = "/v1/chat/completions"
NO_THINKING = {"thinking": {"type": "disabled"}}
MESSAGES = [{"role": "user", "content": "one two three"}]
ACCESS = "deepinfer_server.access"


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ACCESS]


def test_version_and_open_routes() -> None:
    async def body() -> None:
        async with serve() as h:
            versions = (await h.client.get("/version")).json()
            assert versions["deepseek_recipe"] == "0.2.0"
            assert versions["version"] and versions["deepinfer"] is None

    run(body)


def test_request_ids(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with serve() as h:
            request = {"model": MODEL, "messages": MESSAGES, **NO_THINKING}
            with caplog.at_level(logging.INFO, logger=ACCESS):
                given = await h.client.post(
                    CHAT, json=request, headers={"X-Request-Id": "trace-42.a:b"}
                )
                unsafe_id = 'bad id<script>"' + "x" * 300
                unsafe = await h.client.post(
                    CHAT, json=request, headers={"X-Request-Id": unsafe_id}
                )
                generated = await h.client.get("/v1/nothing")
            assert given.headers["x-request-id"] == "trace-42.a:b"
            assert given.json()["id"] == "chatcmpl-trace-42.a:b"
            assert unsafe.headers["x-request-id"] == ("badidscript" + "x" * 300)[:128]
            assert generated.status_code == 404
            assert len(generated.headers["x-request-id"]) == 32
            (line,) = [line for line in access_lines(caplog) if "request_id=trace-42.a:b" in line]
            assert "POST /v1/chat/completions 200" in line
            for field in (
                "prompt_tokens=",
                "completion_tokens=",
                "ttft_ms=",
                "duration_ms=",
                "finish_reason=stop",
            ):
                assert field in line

    run(body)


def test_api_keys_guard_v1_routes_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "sk-very-secret-key-123"
    monkeypatch.setenv("DEEPINFER_API_KEY", secret)

    async def body() -> None:
        async with serve("--log-level", "debug") as h:
            missing = await h.client.get("/v1/models")
            assert missing.status_code == 401
            assert missing.json()["error"]["code"] == "invalid_api_key"
            wrong = await h.client.get("/v1/models", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            bearer = await h.client.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})
            assert bearer.status_code == 200
            anthropic_style = await h.client.get("/v1/models", headers={"x-api-key": secret})
            assert anthropic_style.status_code == 200
            unauthorised = await h.client.post(CHAT, json={"model": MODEL, "messages": MESSAGES})
            assert unauthorised.status_code == 401
            for open_path in ("/health", "/metrics", "/version"):
                assert (await h.client.get(open_path)).status_code == 200
            async with h.openai(api_key=secret) as client:
                reply = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
                assert reply.choices
            async with h.openai(api_key="wrong") as stranger:
                with pytest.raises(openai.AuthenticationError):
                    await stranger.models.list()
            # Anyone can be refused without a key: 401s are not failures of the service, or a
            # stranger's requests would page the operator.
            exposition = parse_metrics((await h.client.get("/metrics")).text)
            assert value(exposition, "deepinfer:request_failure_total", status="401") == 0
            assert failures(h.metrics) == {}

    with caplog.at_level(logging.DEBUG):
        run(body)
    assert caplog.records  # the access log at least: the capture saw the app's logging
    assert secret not in caplog.text


def test_access_log_options_and_prompt_privacy(caplog: pytest.LogCaptureFixture) -> None:
    marker = "PROMPT-MARKER-7781"
    request = {"model": MODEL, "messages": [{"role": "user", "content": marker}], **NO_THINKING}

    async def quiet() -> None:
        async with serve() as h:
            await h.client.post(CHAT, json=request, headers={"X-Request-Id": "q1"})

    async def verbose() -> None:
        async with serve("--disable-access-log", "--log-requests") as h:
            await h.client.post(CHAT, json=request, headers={"X-Request-Id": "v1"})

    with caplog.at_level(logging.INFO):  # the server's default --log-level
        run(quiet)
    assert any("request_id=q1" in line for line in access_lines(caplog))
    assert marker not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        run(verbose)
    assert marker in caplog.text
    assert "request_id=v1" not in caplog.text
    assert access_lines(caplog) == []


def test_cors_is_off_by_default_and_configurable() -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}

    async def body() -> None:
        async with serve() as h:
            plain = await h.client.options(CHAT, headers=preflight)
            assert "access-control-allow-origin" not in plain.headers
        async with serve("--allowed-origins", "https://app.example") as h:
            allowed = await h.client.options(CHAT, headers=preflight)
            assert allowed.status_code == 200
            assert allowed.headers["access-control-allow-origin"] == "https://app.example"
            other = await h.client.options(
                CHAT, headers={**preflight, "Origin": "https://evil.example"}
            )
            assert "access-control-allow-origin" not in other.headers

    run(body)


def test_max_request_bytes_declared_and_undeclared() -> None:
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    payload = orjson.dumps(big)
    pulled: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(payload), 512):
            pulled.append(start)
            yield payload[start : start + 512]

    async def body() -> None:
        async with serve("--max-request-bytes", "2048") as h:
            declared = await h.client.post(CHAT, json=big)
            assert declared.status_code == 413
            assert declared.json()["error"]["code"] == "request_too_large"
            length = {"content-type": "application/json", "content-length": str(len(payload))}
            early = await h.client.post(CHAT, content=chunks(), headers=length)
            assert early.status_code == 413
            assert len(pulled) <= 1, pulled  # refused by its Content-Length, before reading it
            pulled.clear()
            undeclared = await h.client.post(
                CHAT, content=chunks(), headers={"content-type": "application/json"}
            )
            assert "content-length" not in undeclared.request.headers  # sent chunked
            assert undeclared.status_code == 413
            assert undeclared.json()["error"]["code"] == "request_too_large"
            assert not h.coordinator.submitted
            assert (await h.client.get("/health")).status_code == 200

    run(body)


def test_bodies_being_read_share_the_receive_budget() -> None:
    """A body whose bytes do not fit in --max-receive-buffer-mb next to those being read is a
    503 with Retry-After: by its Content-Length before any byte is read, or as its chunks
    arrive; the bytes are given back once a body is read."""
    payload = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    pulled: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(payload), 16):
            pulled.append(start)
            yield payload[start : start + 16]

    async def body() -> None:
        async with serve("--max-receive-buffer-mb", "1") as h:
            budget = h.state.receiving
            others = budget.limit - len(payload) // 2  # other bodies being read: half is left
            assert budget.take(others)
            length = {"content-type": "application/json", "content-length": str(len(payload))}
            declared = await h.client.post(CHAT, content=chunks(), headers=length)
            assert declared.status_code == 503
            assert declared.headers["retry-after"] == "1"
            assert declared.json()["error"]["code"] == "receive_buffer_full"
            assert len(pulled) <= 1, pulled  # refused by its Content-Length, before reading it
            pulled.clear()
            chunked = await h.client.post(
                CHAT, content=chunks(), headers={"content-type": "application/json"}
            )
            assert chunked.status_code == 503
            assert 1 < len(pulled) < len(payload) // 16 + 1  # refused once its chunks filled it
            assert not h.coordinator.submitted
            budget.give(others)
            assert budget.used == 0  # the refused bodies gave back what they held
            served = await h.client.post(CHAT, content=payload, headers=length)
            assert served.status_code == 200, served.text
            assert budget.used == 0

    run(body)

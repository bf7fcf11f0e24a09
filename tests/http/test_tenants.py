"""Tenants in the HTTP layer: a request's `priority` (every API, honoured or a 400) and its API
key's name (`--api-key-file`) reach admission, the access log names the key, never the key."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.http.harness import MODEL, client_http, run, serve

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
RESPONSES, MESSAGES = "/v1/responses", "/v1/messages"
USER = [{"role": "user", "content": "one two three"}]
BODIES: dict[str, dict[str, Any]] = {
    CHAT: {"model": MODEL, "messages": USER, "thinking": {"type": "disabled"}},
    COMPLETIONS: {"model": MODEL, "prompt": "one two three", "max_tokens": 4},
    RESPONSES: {"model": MODEL, "input": "one two three", "store": False},
    MESSAGES: {"model": MODEL, "messages": USER, "max_tokens": 8},
}
SECRETS = ("sk-evals-0123456789", "sk-agents-9876543210")


@pytest.mark.parametrize("path", list(BODIES))
def test_priority_reaches_admission_in_every_api(path: str) -> None:
    async def body() -> None:
        async with serve() as h:
            for priority in (-5, 2**31 - 1, None):
                request = dict(BODIES[path])
                if priority is not None:
                    request["priority"] = priority
                response = await h.client.post(path, json=request)
                assert response.status_code == 200, response.text
                request_id = h.coordinator.submitted[-1][0]
                assert h.coordinator.placement[request_id] == (0, priority or 0)

    run(body)


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("bad", ["high", 1.5, True, 2**31, -(2**31) - 1, [1]])
def test_a_priority_that_is_not_an_int32_is_a_400(path: str, bad: Any) -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.post(path, json={**BODIES[path], "priority": bad})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert "'priority'" in error["message"]
            if path == MESSAGES:
                assert error["type"] == "invalid_request_error"
            else:
                assert error["param"] == "priority"
            assert h.coordinator.submitted == []

    run(body)


def test_the_official_clients_send_priority_as_an_extension() -> None:
    async def body() -> None:
        async with serve() as h:
            async with h.openai() as client:
                await client.chat.completions.create(
                    model=MODEL,
                    messages=USER,
                    extra_body={"priority": 3},  # type: ignore[arg-type]
                )
            assert h.coordinator.placement[h.coordinator.submitted[-1][0]] == (0, 3)
            http = client_http.AsyncClient(transport=client_http.ASGITransport(app=h.app))
            async with anthropic.AsyncAnthropic(
                base_url="http://test", api_key="unused", http_client=http, max_retries=0
            ) as claude:
                await claude.messages.create(
                    model=MODEL,
                    max_tokens=8,
                    messages=USER,  # type: ignore[arg-type]
                    extra_body={"priority": -2},
                )
            assert h.coordinator.placement[h.coordinator.submitted[-1][0]] == (0, -2)

    run(body)


def test_named_keys_reach_admission_and_the_access_log_without_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"evals {SECRETS[0]} max_running=2\nagents {SECRETS[1]} weight=2\n")

    async def body() -> None:
        async with serve("--api-key", "sk-plain-key-555", "--api-key-file", str(keys)) as h:
            for index, key in enumerate(("sk-plain-key-555", *SECRETS)):
                response = await h.client.post(
                    CHAT, json=BODIES[CHAT], headers={"Authorization": f"Bearer {key}"}
                )
                assert response.status_code == 200, response.text
                assert h.coordinator.placement[h.coordinator.submitted[-1][0]][0] == index
            refused = await h.client.post(
                CHAT, json=BODIES[CHAT], headers={"x-api-key": SECRETS[0] + "x"}
            )
            assert refused.status_code == 401

    with caplog.at_level(logging.DEBUG):
        run(body)
    access = [r.getMessage() for r in caplog.records if r.name == "deepinfer_server.access"]
    tenants = [line.split(" tenant=")[1].split()[0] for line in access if " tenant=" in line]
    assert tenants == ["api-key-1", "evals", "agents"]
    assert not [key for key in (*SECRETS, "sk-plain-key-555") if key in caplog.text]


def test_a_request_needing_more_than_its_key_may_ever_hold_is_a_400() -> None:
    """With two keys, each may hold 3 running (0.75 of 4) and 4 waiting (0.5 of 8): a request
    of 8 choices would be refused with a 429 every time it is sent, even on an idle server."""

    async def body() -> None:
        keys = ("--api-key", SECRETS[0], "--api-key", SECRETS[1])
        flags = ("--max-num-seqs", "4", "--max-queued-requests", "8")
        async with serve(*keys, *flags) as h:
            headers = {"Authorization": f"Bearer {SECRETS[0]}"}
            request = {**BODIES[COMPLETIONS], "n": 8}
            response = await h.client.post(COMPLETIONS, json=request, headers=headers)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "n"
            assert "this API key may have at most 7 in flight" in error["message"]
            assert "--key-queued-share" in error["message"]
            assert h.coordinator.submitted == []
            request["n"] = 7
            response = await h.client.post(COMPLETIONS, json=request, headers=headers)
            assert response.status_code == 200, response.text
            assert len(response.json()["choices"]) == 7

    run(body)

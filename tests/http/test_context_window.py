"""By default (`--clamp-max-tokens`) a max_tokens beyond the room the prompt leaves is lowered to
that room in every protocol, and the answer ends with that protocol's length finish (OpenCode asks
max_tokens 32000 with a 7k-token prompt on a 32k window); with `--no-clamp-max-tokens` the request
stays a 400, and a prompt that alone fills the window is a 400 either way."""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer_server.ipc.messages import Finish
from tests.http.harness import MODEL, Script, run, serve

CONTEXT = 4096  # the harness's --max-model-len
USER = [{"role": "user", "content": "Write a long story."}]

#: path, body asking 64000 output tokens, how the answer reports a length finish.
CASES: list[tuple[str, dict[str, Any], Any]] = [
    (
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 64000},
        lambda r: r["choices"][0]["finish_reason"] == "length",
    ),
    (
        "/v1/chat/completions",
        {"messages": USER, "max_completion_tokens": 64000},
        lambda r: r["choices"][0]["finish_reason"] == "length",
    ),
    (
        "/v1/responses",
        {"input": "Write a long story.", "max_output_tokens": 64000, "store": False},
        lambda r: (
            r["status"] == "incomplete"
            and r["incomplete_details"] == {"reason": "max_output_tokens"}
        ),
    ),
    (
        "/v1/messages",
        {"messages": USER, "max_tokens": 64000},
        lambda r: r["stop_reason"] == "max_tokens",
    ),
    (
        "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": 64000},
        lambda r: r["choices"][0]["finish_reason"] == "length",
    ),
]
IDS = ["chat", "chat-max-completion-tokens", "responses", "messages", "completions"]


@pytest.mark.parametrize(("path", "extra", "is_length_finish"), CASES, ids=IDS)
@pytest.mark.parametrize("flags", [(), ("--clamp-max-tokens",)], ids=["default", "explicit"])
def test_max_tokens_is_lowered_to_the_room_left(
    path: str, extra: dict[str, Any], is_length_finish: Any, flags: tuple[str, ...]
) -> None:
    async def body() -> None:
        script = Script(text="Once upon a time", finish=Finish.LENGTH)
        async with serve(*flags, script=script) as h:
            response = await h.client.post(path, json={"model": MODEL, **extra})
            assert response.status_code == 200, response.text
            _, prompt, sampling = h.coordinator.submitted[-1]
            assert sampling.max_tokens == CONTEXT - len(prompt)
            assert is_length_finish(response.json()), response.json()

    run(body)


@pytest.mark.parametrize(("path", "extra", "is_length_finish"), CASES, ids=IDS)
def test_no_clamp_max_tokens_refuses_it_with_a_400(
    path: str, extra: dict[str, Any], is_length_finish: Any
) -> None:
    async def body() -> None:
        async with serve("--no-clamp-max-tokens") as h:
            response = await h.client.post(path, json={"model": MODEL, **extra})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            anthropic = "exceed context limit" in error["message"]  # Claude Code's wording
            assert error.get("code") == "context_length_exceeded" or anthropic, error
            assert not h.coordinator.submitted

    run(body)


def test_a_request_that_fits_and_a_prompt_that_does_not_are_left_alone() -> None:
    async def body() -> None:
        async with serve() as h:
            fits = {"model": MODEL, "messages": USER, "max_tokens": 100}
            assert (await h.client.post("/v1/chat/completions", json=fits)).status_code == 200
            assert h.coordinator.submitted[-1][2].max_tokens == 100
            too_long = [{"role": "user", "content": "word " * 5000}]
            body = {"model": MODEL, "messages": too_long, "max_tokens": 10}
            response = await h.client.post("/v1/chat/completions", json=body)
            assert response.status_code == 400
            assert response.json()["error"]["code"] == "context_length_exceeded"
            assert len(h.coordinator.submitted) == 1

    run(body)

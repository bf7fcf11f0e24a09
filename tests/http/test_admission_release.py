"""Every exit of a generation request after admission frees what admission took,
or a server leaks its capacity away one failed request at a time.

A failure is injected at each step `serve_generation` takes between admitting a request and
handing it to its response (records, the protocol output, the token streams, the choice merger),
for one choice and for several, streaming and not: the client gets an answer (500 for the
injected bug) and no handle, hence no admission slot, stays in flight.
"""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer_server.api import endpoint
from tests.http.harness import MODEL, run, serve

CHAT = "/v1/chat/completions"
#: The steps after admission of one choice's path and of several choices' path.
STEPS = [(1, "RequestRecord"), (1, "TokenStream"), (3, "RequestRecord"), (3, "TokenStream")]
STEPS.append((3, "ChoiceMerger"))


class InjectedFault(Exception):
    """The bug a test injects."""


def _failing(*args: Any, **kwargs: Any) -> Any:
    raise InjectedFault("injected")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("n", "step"), STEPS)
def test_a_failure_after_admission_releases_every_handle(
    n: int, step: str, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(endpoint, step, _failing)

    async def body() -> None:
        async with serve() as h:
            request = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "thinking": {"type": "disabled"},
                "n": n,
                "stream": stream,
            }
            response = await h.client.post(CHAT, json=request)
            assert response.status_code == 500, response.text
            assert len(h.coordinator.submitted) == n
            assert h.coordinator.handles == {}, f"{step}: {list(h.coordinator.handles)}"

    run(body)

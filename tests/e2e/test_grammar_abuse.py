"""The grammar-abuse set over HTTP against a live server, on the simulated engine and
on DeepInfer's own grammar engine (the CPU twin): each case is a 400, a 500
`structured_output_failed` or a 200, as its outcomes allow, and the server stays healthy and
answers a plain request after it (a `{"$ref": "#"}` schema used to kill the rank: 503 for
everyone)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.checkpoint import write_checkpoint
from tests.conftest import MODEL
from tests.deepinfer_twin import engine_env
from tests.grammar_abuse import CASES, GrammarAbuseCase, describe
from tests.lanes import require_grammar
from tests.server import LiveServer

require_grammar()
pytestmark = pytest.mark.grammar

_STATUS = {400: "refused", 500: "grammar_failed", 200: "answered"}


@pytest.fixture(
    scope="module",
    params=["simulated", pytest.param("deepinfer", marks=pytest.mark.deepinfer_twin)],
)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    # DEEPINFER_XGRAMMAR_TIMEOUT 6: the API's compile bound is 3 s, the engine's 6 s.
    env = {"DEEPINFER_XGRAMMAR_TIMEOUT": "6"}
    if request.param == "simulated":
        args = ["--sim-itl-ms", "2"]
    else:
        checkpoint = write_checkpoint(tmp_path_factory.mktemp("abuse") / "DeepSeek-V4.1-Flash")
        args = [str(checkpoint), "--served-model-name", MODEL, "--ep", "1"]
        env |= engine_env("0")
    with LiveServer(*args, "--step-timeout", "20", engine=request.param, env=env) as live:
        yield live


def _chat(server: LiveServer, extra: dict[str, Any]) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 32,
        "thinking": {"type": "disabled"},
        **extra,
    }
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_case_fails_or_succeeds_alone(server: LiveServer, case: GrammarAbuseCase) -> None:
    response = _chat(server, case.body)
    outcome = _STATUS.get(response.status_code, str(response.status_code))
    assert outcome in case.outcomes, f"{describe(case)} -> {response.status_code} {response.text}"
    if outcome == "grammar_failed":
        assert response.json()["error"]["code"] == "structured_output_failed", response.text
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    plain = _chat(server, {})
    assert plain.status_code == 200, plain.text

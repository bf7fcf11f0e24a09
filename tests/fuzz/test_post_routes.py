"""Schemathesis over every POST route of /openapi.json, against a live simulated server.

Fails on any 5xx, on any request that takes longer than REQUEST_TIMEOUT (a hang), and on any
slot still held once the run is over (`/get_load` back to 0, `/health` still ok: checked as the
server's fixture ends, so that each pytest-xdist worker checks the server its cases used). Bounded:
MAX_EXAMPLES cases per route and mode (schemathesis sends schema-valid and schema-violating
bodies), no shrinking; the whole lane takes a few minutes on 2 cores.

Deterministic by default (the same cases every run, so CI is reproducible);
DEEPINFER_FUZZ_SEED=N explores other cases, DEEPINFER_FUZZ_EXAMPLES=N changes the bound, and
DEEPINFER_FUZZ_KEEP_GOING=1 lists every distinct failure at the end (one reproducer each)
instead of stopping each route at its first.
"""

from __future__ import annotations

import collections
import itertools
import os
import re
import time
from collections.abc import Iterator

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, seed, settings

from deepinfer_server.api.route_table import ROUTES
from deepinfer_server.api.routes.openapi import openapi_document
from tests.server import LiveServer

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(300)]

MAX_EXAMPLES = int(os.environ.get("DEEPINFER_FUZZ_EXAMPLES", "150"))
#: Longer than any answer of this server takes (2048 tokens at 0 ms a step), far shorter than
#: its own --request-timeout: a request still unanswered then is hung.
REQUEST_TIMEOUT = 30.0
#: How long the aborts of requests the run gave up on may take to free their slots.
SETTLE_TIMEOUT = 10.0
_SEED = os.environ.get("DEEPINFER_FUZZ_SEED")
#: The simulated server's default name, so that most bodies get past the model check.
SERVED_MODEL_NAMES = ("deepseek-flash",)
_KEEP_GOING = os.environ.get("DEEPINFER_FUZZ_KEEP_GOING") == "1"
_request_ids = itertools.count()
#: (route, status) → how many cases got it: printed at the end (`-s`), to see how deep the
#: cases reach (mostly 400s means they stop at the first checks).
_STATUSES: collections.Counter[tuple[str, int]] = collections.Counter()
#: The line of a traceback that names the exception ("OverflowError: ...").
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b")
#: The start of a log record (the server's format begins with the date).
_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d ")
#: (route, what went wrong) → a curl command that reproduces it (keep-going mode).
_FAILURES: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[LiveServer]:
    """Two DP ranks, fast steps, a small context (every answer ends quickly)."""
    with LiveServer(
        "--dp",
        "2",
        "--ep",
        "2",
        "--sim-ttft-ms",
        "0",
        "--sim-itl-ms",
        "0",
        "--max-model-len",
        "2048",
    ) as server:
        _warm_up_the_grammar_compiler(server)
        yield server
        _check_nothing_is_held_and_the_server_is_healthy(server)


def _warm_up_the_grammar_compiler(server: LiveServer) -> None:
    """The first structured request builds the compiler's vocabulary tables (tens of seconds
    on a loaded 2-core machine): once, before the cases, so that REQUEST_TIMEOUT measures hangs
    rather than that start-up."""
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "model": SERVED_MODEL_NAMES[0],
            "messages": [{"role": "user", "content": "Answer in JSON"}],
            "response_format": {"type": "json_object"},
            "thinking": {"type": "disabled"},
            "max_tokens": 1,
        },
        timeout=180,
    )
    assert response.status_code == 200, response.text


#: The document the server serves (tests/http/test_openapi.py checks that it is this one, and
#: test_the_server_serves_the_document_fuzzed here checks it for the live server).
schema = schemathesis.openapi.from_dict(
    openapi_document(SERVED_MODEL_NAMES, ROUTES),
    config=schemathesis.Config.from_dict(
        {
            "generation": {"mode": "all", "database": "none"},
            # Reproducers must show the body as sent (it would hide `max_tokens` as a secret).
            "output": {"sanitization": {"enabled": False}},
        }
    ),
).include(method="POST")


def _settings(test):  # type: ignore[no-untyped-def]
    bounded = settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=_SEED is None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )(test)
    return seed(int(_SEED))(bounded) if _SEED is not None else bounded


def test_the_server_serves_the_document_fuzzed_here(fuzz_server: LiveServer) -> None:
    served = httpx.get(f"{fuzz_server.base_url}/openapi.json", timeout=10)
    assert served.json() == openapi_document(SERVED_MODEL_NAMES, ROUTES)


@schema.parametrize()
@_settings
def test_no_request_is_a_server_error_or_hangs(
    case: schemathesis.Case, fuzz_server: LiveServer
) -> None:
    curl = case.as_curl_command(base_url=fuzz_server.base_url)
    request_id = f"fuzz-{next(_request_ids)}"
    try:
        response = case.call(
            base_url=fuzz_server.base_url,
            headers={"X-Request-Id": request_id},
            timeout=REQUEST_TIMEOUT,
        )
    except requests.Timeout:
        _fail(case.path, f"no answer within {REQUEST_TIMEOUT} s", curl)
        return
    _STATUSES[(case.path, response.status_code)] += 1
    if response.status_code >= 500:
        what = _logged_exception(fuzz_server, request_id) or response.text[:300]
        _fail(case.path, f"{response.status_code} {what}", curl)


def _logged_exception(server: LiveServer, request_id: str) -> str | None:
    """The exception line of the traceback the server logged for a 500 (its cause)."""
    try:
        # The access-log line comes after the error record: the traceback is complete then.
        server.wait_for_line(f"request_id={request_id} ", timeout=5)
    except TimeoutError:
        return None
    marker = f"request {request_id}: unexpected error"
    if marker not in server.log:
        return None
    record = []
    for line in server.log.split(marker, 1)[1].splitlines()[1:]:
        if _LOG_RECORD.match(line):
            break
        record.append(line)
    causes = [line.strip() for line in record if _EXCEPTION_LINE.match(line)]
    return causes[-1] if causes else None


def _fail(route: str, what: str, curl: str) -> None:
    if not _KEEP_GOING:
        pytest.fail(f"{route}: {what}\n{curl}")
    _FAILURES.setdefault((route, what), curl)


def _check_nothing_is_held_and_the_server_is_healthy(fuzz_server: LiveServer) -> None:
    """After the cases this process ran (the fixture's teardown, so that it runs last in each
    pytest-xdist worker): every request they made has freed its slot, the server and its ranks
    are alive, and keep-going mode's failures are listed."""
    print("\nstatuses:", dict(sorted(_STATUSES.items())))
    listed = [f"{route}: {what}\n  {curl}" for (route, what), curl in sorted(_FAILURES.items())]
    base = fuzz_server.base_url
    deadline = time.monotonic() + SETTLE_TIMEOUT
    load = httpx.get(f"{base}/get_load", timeout=10).json()["load"]
    while load and time.monotonic() < deadline:
        time.sleep(0.1)  # polling a gauge the aborts lower; nothing to await from outside
        load = httpx.get(f"{base}/get_load", timeout=10).json()["load"]
    assert load == 0, f"{load} slots still held after the run"
    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 200, health.text
    assert fuzz_server.process.poll() is None
    assert len(fuzz_server.rank_processes()) == 2
    assert not listed, f"{len(listed)} distinct failures:\n" + "\n".join(listed)

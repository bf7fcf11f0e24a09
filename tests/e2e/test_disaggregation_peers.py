"""A decode server with two prefill servers, one of them stalled (its rank process stopped, as
SIGSTOP leaves it): the healthy one's requests go on, the stalled one's fail (at the transfer
timeout, then at once), and the decode side's KV comes back once the stalled one resumes."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.test_disaggregation import CHAT, COMMON, handoff, start_prefill
from tests.lanes import require_disaggregation
from tests.metrics_scrape import scrape, value
from tests.paths import PD_SECRET_ARGS
from tests.server import LiveServer, wait_until

require_disaggregation()
pytestmark = pytest.mark.disaggregation

#: The decode server's transfer timeout (seconds): short, so the test is.
TIMEOUT = 4.0
#: A prefill peer's transfer threads on the decode side (`transfer.lanes`), plus one queued.
STALLED_REQUESTS = 5


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[LiveServer, LiveServer, LiveServer]]:
    """The prefill server to stall, the healthy one and the decode server."""
    decode_args = (
        *PD_SECRET_ARGS,
        "--disaggregation-mode",
        "decode",
        "--disaggregation-transfer-timeout",
    )
    with (
        start_prefill() as stalled,
        start_prefill() as healthy,
        LiveServer(*COMMON, *decode_args, str(TIMEOUT)) as decode,
    ):
        yield stalled, healthy, decode


def decode_leg(decode: LiveServer, params: dict[str, Any]) -> httpx.Response:
    body = {**CHAT, "kv_transfer_params": params}
    return httpx.post(decode.base_url + "/v1/chat/completions", json=body, timeout=60)


def kv_usage(decode: LiveServer) -> float:
    return value(scrape(decode.base_url), "deepinfer:kv_cache_usage_perc", dp_rank="0")


def test_a_stalled_prefill_server_holds_up_only_its_own_requests(
    servers: tuple[LiveServer, LiveServer, LiveServer],
) -> None:
    stalled, healthy, decode = servers
    cap = "max_tokens"
    for server in (stalled, healthy):  # the decode side knows both peers before one stalls
        warm = decode_leg(decode, handoff(server, "/v1/chat/completions", CHAT, cap))
        assert warm.status_code == 200, warm.text
    stuck = [handoff(stalled, "/v1/chat/completions", CHAT, cap) for _ in range(STALLED_REQUESTS)]
    fine = handoff(healthy, "/v1/chat/completions", CHAT, cap)
    ranks = stalled.rank_processes()
    for rank in ranks:
        rank.suspend()
    try:
        with ThreadPoolExecutor(STALLED_REQUESTS) as pool:
            pending = [pool.submit(decode_leg, decode, params) for params in stuck]
            wait_until(lambda: kv_usage(decode) > 0, TIMEOUT, "the stalled peer's pulls")
            answer = decode_leg(decode, fine)
            assert answer.status_code == 200, answer.text
            assert not all(future.done() for future in pending)  # before their timeout
            failed = [future.result() for future in pending]
        for response in failed:
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "kv_transfer_failed"
        messages = " ".join(response.json()["error"]["message"] for response in failed)
        assert "(timeout)" in messages
        again = decode_leg(decode, stuck[0])
        assert again.status_code == 503 and "(peer_unhealthy)" in again.text
        assert again.elapsed.total_seconds() < TIMEOUT  # at once, not after the timeout
        assert kv_usage(decode) > 0  # the started pulls' blocks: their reads may still write
    finally:
        for rank in ranks:
            rank.resume()
    wait_until(lambda: kv_usage(decode) == 0, 30, "the quarantined blocks back once it resumed")
    # Its stuck reads succeeded once it resumed: it is well again, not skipped any more.
    later = decode_leg(decode, handoff(stalled, "/v1/chat/completions", CHAT, cap))
    assert later.status_code == 200, later.text

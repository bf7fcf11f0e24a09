"""One API key's flood leaves room for another key's requests, on one small simulated server
(4 running slots, a queue of 8, two named keys): background responses, which hold no
connection, fill only the flooding key's share of the queue, and that key alone gets the 429,
naming the limit and its flag; a batch of lines with `n` takes only idle slots, counted per
engine request, while the other key's requests are answered."""

from __future__ import annotations

import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import orjson
import pytest

from tests.metrics_scrape import scrape, value
from tests.server import LiveServer, wait_until

MODEL = "deepseek-flash"
FLOODER, VICTIM = "sk-e2e-flooder-1", "sk-e2e-victim-2"
#: A background response of several seconds (the simulated model echoes its input, 20 ms a
#: token): none of the flood ends while it is sent.
LONG_INPUT = " ".join(f"word{index}" for index in range(400))
SHORT_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "one two three"}],
    "max_tokens": 2,
    "thinking": {"type": "disabled"},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Running share 3 of 4 slots per key, queue share 4 of 8: one key holds 7 at most."""
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"flooder {FLOODER}\nvictim {VICTIM}\n")
    with LiveServer(
        "--max-num-seqs",
        "4",
        "--max-queued-requests",
        "8",
        "--sim-ttft-ms",
        "5",
        "--sim-itl-ms",
        "20",
        "--max-model-len",
        "4096",
        "--api-key-file",
        str(keys),
    ) as server:
        yield server


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _held(server: LiveServer, tenant: str) -> float:
    """The key's requests running and queued."""
    metrics = scrape(server.base_url)
    return value(metrics, "deepinfer:tenant_requests_running", tenant=tenant) + value(
        metrics, "deepinfer:tenant_requests_queued", tenant=tenant
    )


def _victim_statuses(server: LiveServer, count: int = 5) -> list[int]:
    """The victim key's `count` requests, sent at once: their statuses."""

    def send(_: int) -> int:
        url = server.base_url + "/v1/chat/completions"
        return httpx.post(url, json=SHORT_CHAT, headers=_headers(VICTIM), timeout=60).status_code

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(send, range(count)))


def test_a_background_flood_is_refused_to_its_key_alone(server: LiveServer) -> None:
    url = server.base_url + "/v1/responses"
    body = {"model": MODEL, "input": LONG_INPUT, "background": True}
    accepted: list[str] = []
    refusal = None
    with httpx.Client(headers=_headers(FLOODER), timeout=60) as client:
        for _ in range(12):
            answer = client.post(url, json=body)
            if answer.status_code == 429:
                refusal = answer.json()["error"]
                break
            assert answer.status_code == 200, answer.text
            accepted.append(answer.json()["id"])
        assert len(accepted) == 7  # 3 running, 4 waiting: the key's shares
        assert refusal is not None
        assert refusal["type"] == "rate_limit_exceeded"
        assert "this API key has 4 requests waiting" in refusal["message"]
        assert "--key-queued-share 0.5 of --max-queued-requests 8" in refusal["message"]
        # The other key: 1 starts in the slot left free, 4 wait in its own share of the queue.
        assert _victim_statuses(server) == [200] * 5
        for response_id in accepted:
            assert client.post(f"{url}/{response_id}/cancel").status_code == 200
    wait_until(lambda: _held(server, "flooder") == 0, 30, "the flood cancelled")


def test_wide_batch_lines_leave_room_for_another_keys_requests(server: LiveServer) -> None:
    line = {
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {**SHORT_CHAT, "max_tokens": 20, "n": 6},
    }
    data = b"".join(orjson.dumps({"custom_id": f"line-{n}", **line}) + b"\n" for n in range(3))
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=FLOODER, max_retries=0) as client:
        upload = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_until(lambda: _held(server, "flooder") >= 3, 30, "a batch line in flight")
        # A line's 6 engine requests: 3 running (the key's share), 3 waiting; no second line.
        assert _held(server, "flooder") <= 6
        assert _victim_statuses(server) == [200] * 5
        wait_until(
            lambda: client.batches.retrieve(batch.id).status == "completed",
            90,
            "the batch to complete",
        )
        counts = client.batches.retrieve(batch.id).request_counts
        assert counts is not None and (counts.completed, counts.failed) == (3, 0)

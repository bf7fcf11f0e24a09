"""The prefix cache's shared store tier end to end: a real `mooncake_master` and two simulated
servers that name it (`--kv-offload-store mooncake`). A conversation's first turn is answered
by one server; its next turn, sent to the other, reuses the first turn's prompt from the store
(counted as the store's hits), and neither another API key nor another `cache_salt` reuses it
there."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import MODEL
from tests.lanes import require_disaggregation
from tests.metrics_scrape import scrape, value
from tests.mooncake_master import MooncakeMaster
from tests.server import LiveServer, wait_until

require_disaggregation()
pytestmark = pytest.mark.disaggregation

FIRST_KEY, SECOND_KEY = "sk-e2e-store-first-1", "sk-e2e-store-second-2"
#: A system prompt of about 2,500 tokens: twenty 128-token blocks.
SYSTEM = " ".join(f"Rule {n}: keep the answer short and check the tests." for n in range(220))
STORE_HITS = "deepinfer:prefix_cache_hit_tokens_total"


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with tempfile.TemporaryDirectory() as folder:
        started = MooncakeMaster(Path(folder) / "master.log")
        try:
            yield started
        finally:
            started.close()


@pytest.fixture(scope="module")
def servers(
    master: MooncakeMaster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveServer, LiveServer]]:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"first {FIRST_KEY}\nsecond {SECOND_KEY}\n")
    store = ("--kv-offload-store", "mooncake", "--kv-offload-store-master")
    # A loaded CI machine must not turn a lookup into a miss: the wait is long here.
    args = (*store, f"127.0.0.1:{master.port}", "--sim-store-lookup-timeout-ms", "5000")
    args += ("--sim-itl-ms", "2", "--api-key-file", str(keys))
    with contextlib.ExitStack() as stack:
        one = stack.enter_context(LiveServer(*args))
        two = stack.enter_context(LiveServer(*args))
        yield one, two


def _chat(server: LiveServer, key: str, messages: list[dict[str, Any]], **extra: Any) -> Any:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    body = {"thinking": {"type": "disabled"}, **extra}
    answer = client.chat.completions.create(model=MODEL, messages=messages, extra_body=body)
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return answer


def test_a_turn_moved_to_another_server_reuses_the_store_within_its_partition(
    master: MooncakeMaster, servers: tuple[LiveServer, LiveServer]
) -> None:
    one, two = servers
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there."}]
    answer = _chat(one, FIRST_KEY, first)
    prompt = answer.usage.prompt_tokens
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    # The first server writes the prompt's whole blocks and its snapshot in the background.
    wait_until(lambda: (master.keys() or 0) >= prompt // 128 + 1, 30, "the first turn's pages")
    second = [
        *first,
        {"role": "assistant", "content": answer.choices[0].message.content},
        {"role": "user", "content": "Now run the tests, please."},
    ]
    # Another key, or another cache_salt, finds nothing of it on the other server.
    assert _chat(two, SECOND_KEY, second).usage.prompt_tokens_details.cached_tokens == 0
    salted = _chat(two, FIRST_KEY, second, cache_salt="another conversation")
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    # The conversation's own next turn resumes from the first turn's state snapshot, at its
    # prompt's end (mid-block: a block boundary has no state to resume from).
    assert prompt % 128
    moved = _chat(two, FIRST_KEY, second)
    assert moved.usage.prompt_tokens_details.cached_tokens == prompt
    samples = scrape(two.base_url)
    assert value(samples, STORE_HITS, tier="store") == prompt
    assert value(samples, "deepinfer:prefix_cache_store_errors_total") == 0

"""A fresh server's first structured requests all succeed, and `/health` answers 200 only once
structured output is warm: the grammar compile workers are prepared in the background once the
server listens, and every rank's grammar builder warms once ready; until both are done `/health`
says 503 `starting` (`deepinfer:grammar_ready` 0), so a load balancer sends the first schema to
a warm server. The four concurrent first schemas sent while it warms wait for the workers, then
for their turn, and are all answered (three of them used to get `400 no grammar compile worker
was free within 10s` while the workers started, and a first `chat.completions.parse` took the
workers' 180 s start-up bound)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pydantic
import pytest

from tests.conftest import MODEL
from tests.lanes import require_grammar
from tests.server import LiveServer

require_grammar()
pytestmark = pytest.mark.grammar


class City(pydantic.BaseModel):
    name: str
    population: int


class Person(pydantic.BaseModel):
    name: str
    age: int


class Book(pydantic.BaseModel):
    title: str
    pages: int
    authors: list[str]


class Flag(pydantic.BaseModel):
    enabled: bool


@pytest.fixture
def fresh_server() -> Iterator[LiveServer]:
    with LiveServer(
        "--sim-itl-ms", "1", startup_timeout=180.0, grammar_warmup=True, healthy=False
    ) as live:
        yield live


def _gauge(server: LiveServer, name: str) -> str:
    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    prefix = f'deepinfer:{name}{{model_name="{MODEL}"}} '
    return next(line for line in metrics.splitlines() if line.startswith(prefix))[len(prefix) :]


def _workers_ready(server: LiveServer) -> str:
    return _gauge(server, "grammar_compile_workers_ready")


def test_four_concurrent_first_schemas_on_a_fresh_server_are_all_answered(
    fresh_server: LiveServer,
) -> None:
    # The server listens while its compile workers and its rank's grammar builder are still
    # being prepared, and says it is starting.
    # (Its start-up line names the port a moment before it accepts connections.)
    health = fresh_server.wait_for_health("starting", timeout=60)
    assert "structured output is warming up" in health["reason"], health
    assert _workers_ready(fresh_server) == "0.0"
    assert _gauge(fresh_server, "grammar_ready") == "0.0"

    async def ask_all() -> list[pydantic.BaseModel | None]:
        async with openai.AsyncOpenAI(
            base_url=f"{fresh_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:

            async def ask(model: type[pydantic.BaseModel]) -> pydantic.BaseModel | None:
                completion = await client.chat.completions.parse(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"One {model.__name__}, please."}],
                    response_format=model,
                    max_tokens=256,
                    extra_body={"thinking": {"type": "disabled"}},
                )
                return completion.choices[0].message.parsed

            return await asyncio.gather(*(ask(m) for m in (City, Person, Book, Flag)))

    parsed = asyncio.run(ask_all())
    assert [type(p) for p in parsed] == [City, Person, Book, Flag]
    metrics = httpx.get(fresh_server.base_url + "/metrics", timeout=10).text
    assert (
        f'deepinfer:grammar_compile_refusals_total{{model_name="{MODEL}",reason="capacity"}} 0.0'
        in metrics
    )
    assert _workers_ready(fresh_server) == "3.0"  # two for one key, the third for another
    # Its compile workers built and checked the four so_args: the API process itself never
    # loaded xgrammar, nor PyTorch with it (about 260 MiB of resident memory per process).
    mapped = Path(f"/proc/{fresh_server.process.pid}/maps").read_text()
    assert "xgrammar" not in mapped
    assert "libtorch" not in mapped
    # The warm-up ends: every worker ready and the rank's grammar builder warm (it built a
    # first matcher, through its own compile worker, a process of the rank's); /health says
    # 200 from then on, never before.
    fresh_server.wait_until_healthy(180)
    assert _gauge(fresh_server, "grammar_ready") == "1.0"
    assert _workers_ready(fresh_server) == "3.0"
    children = psutil.Process(fresh_server.process.pid).children()
    [rank] = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
    [fork_server] = [p for p in rank.children() if "forkserver" in " ".join(p.cmdline())]
    assert fork_server.children()  # the rank's compile worker

"""The hard reasoning budget on DeepInfer 0.1.0's own engine (the CPU twin): the server's
engine driver ends the engine request at the budget and adds the one that continues after
`</think>`, on DeepInfer's C++ scheduler and request-output pool, with and without the prefix
cache (which turns the continuation into a fork of the cached prompt).
"""

from __future__ import annotations

from pathlib import Path

import anthropic
import pytest

from tests.checkpoint import write_checkpoint
from tests.deepinfer_twin import engine_env
from tests.deepinfer_twin.runner import run_in_twin
from tests.server import LiveServer

pytestmark = pytest.mark.deepinfer_twin

REASONING = "step " * 200
ANSWER = "The answer is 42."
TURN = f"{REASONING}</think>{ANSWER}"

BODY = f"""
END = TOKENIZER.token_to_id("</think>")
rendered = "<｜begin▁of▁sentence｜><｜User｜>{TURN}<｜Assistant｜><think>"
ids = TOKENIZER.encode(rendered, add_special_tokens=False).ids
reasoning = TOKENIZER.encode("{REASONING}", add_special_tokens=False).ids
sampling = SamplingOptions(max_tokens=400, thinking_budget=64, thinking_end_id=END)
assert DRIVER.add(AddRequest("b", pack_token_ids(ids), sampling)) is None
out = run()["b"]
tokens = out["tokens"]
RESULT = {{
    "reasoning_ok": tokens[:64] == reasoning[:64],
    "end_at": tokens.index(END),
    "answer": text_of(tokens[65:]),
    "finish": out["finish"],
    "live": DRIVER.num_live,
    "computed": DRIVER.counters().prompt_tokens_computed,
    "prompt": len(ids),
}}
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("twin-budget") / "DeepSeek-V4.1-Flash")


@pytest.mark.parametrize("cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_the_budget_forces_the_end_of_reasoning_on_deepinfer(checkpoint: Path, cache: bool) -> None:
    engine = {"prefix_cache": {"min_tokens": 64}} if cache else None
    result = run_in_twin(checkpoint, BODY, engine=engine)
    assert result["reasoning_ok"] and result["end_at"] == 64
    assert result["answer"] == ANSWER and result["finish"] == "STOP"
    assert result["live"] == 0
    # The prompt, then the continuation: prompt + reasoning + </think> again, or with the
    # prefix cache (the aborted request's prompt is kept) only reasoning + </think>.
    prompt = result["prompt"]
    assert result["computed"] == prompt + (0 if cache else prompt) + 64 + 1


def test_a_messages_budget_through_the_server_on_deepinfer(checkpoint: Path) -> None:
    env = engine_env("0,1,2,3,4,5,6,7")
    with LiveServer(str(checkpoint), "--ep", "1", engine="deepinfer", env=env) as server:
        client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
        message = client.messages.create(
            model=str(checkpoint),
            max_tokens=1024,
            messages=[{"role": "user", "content": TURN}],
            thinking={"type": "enabled", "budget_tokens": 64},
        )
        assert [block.type for block in message.content] == ["thinking", "text"]
        thinking = message.content[0].thinking  # type: ignore[union-attr]
        assert thinking and REASONING.startswith(thinking) and thinking != REASONING
        assert message.content[1].text == ANSWER  # type: ignore[union-attr]
        assert message.usage.output_tokens <= 64 + 1 + 16

"""DeepInfer 0.1.0's own engine (the CPU twin) driven by the server's engine driver.

Each test runs one DP rank of DeepInfer's LLMEngine in a fresh process (`run_in_twin`): its
C++ scheduler, request-output pool, SamplingParams, grammar builder and matchers, with the
twin's model. These are the defects a stand-in that behaves as we believed could not show.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.checkpoint import write_checkpoint
from tests.deepinfer_twin import engine_env
from tests.deepinfer_twin.runner import run_in_twin
from tests.server import LiveServer

pytestmark = pytest.mark.deepinfer_twin

REGEX = {"schema_type": "regex", "schema": "[a-z]{1,3}"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("twin") / "DeepSeek-V4.1-Flash")


def test_the_twin_is_deepinfers_own_engine(checkpoint: Path) -> None:
    result = run_in_twin(
        checkpoint,
        """
        import deepinfer.engine.llm_engine as module
        add("r1", "Hello from the twin")
        RESULT = {"module": module.__file__, "run": run(), "eos": ENGINE.eos_id}
        RESULT["text"] = text_of(RESULT["run"]["r1"]["tokens"])
        """,
    )
    assert result["module"].startswith(os.environ["DEEPINFER_TWIN_DIR"])
    assert result["text"] == "Hello from the twin"
    assert result["run"]["r1"]["finish"] == "STOP"
    assert result["eos"] == 1


def test_an_add_request_failure_fails_that_request_and_the_rank_serves_on(
    checkpoint: Path,
) -> None:
    # More grammar CPUs than DeepInfer may bind per GPU: its grammar worker pool raises
    # RuntimeError inside add_request (utils.get_idle_cpus), on every structured request.
    result = run_in_twin(
        checkpoint,
        f"""
        rejected = add("so", "abc", structured=StructuredOutput(**{REGEX!r}))
        accepted = add("text", "still serving")
        RESULT = {{
            "rejected": [rejected.kind, rejected.message] if rejected else None,
            "accepted": accepted is None,
            "run": run(),
        }}
        """,
        env={"DEEPINFER_SO_BUILDER_CPUS": "64"},
    )
    kind, message = result["rejected"]
    assert kind == "engine_error"
    assert "RuntimeError" in message and "so_builder_cpus" in message
    assert result["accepted"]
    assert result["run"]["text"]["finish"] == "STOP"
    assert "so" not in result["run"]


def test_an_abort_while_the_grammar_compiles_is_not_lost(checkpoint: Path) -> None:
    # Until DeepInfer's builder pump enqueues it, the sequence is in no scheduler queue and
    # abort_request finds nothing: the driver must abort it again once it is there.
    result = run_in_twin(
        checkpoint,
        """
        structured = StructuredOutput(**{"schema_type": "regex", "schema": "a{1,3000}"})
        assert add("so", "aaaa", max_tokens=3000, ignore_eos=True, structured=structured) is None
        DRIVER.abort(["so"])
        iterate(60)
        RESULT = {
            "unfinished": ENGINE.get_num_unfinished_requests(),
            "free_blocks": ENGINE.scheduler.get_num_free_gpu_blocks(),
            "total_blocks": ENGINE.cache_config.num_gpu_blocks,
        }
        """,
        env={"DEEPINFER_SO_BUILDER_CPUS": "0"},
    )
    assert result["unfinished"] == 0
    assert result["free_blocks"] == result["total_blocks"] - 1  # block 0 is never allocatable


def test_structured_output_through_the_server_on_deepinfers_grammar_engine(
    checkpoint: Path,
) -> None:
    # DeepInfer's default of 4 grammar CPUs per GPU does not fit this node (8 GPUs on this
    # machine's cores): without the start-up check every structured request took the rank down.
    # The server speculates (--speculative-tokens reaches DeepInfer's Python and C++ through
    # the rank's environment): the grammar's answer comes through drafts, and /metrics counts
    # them from DeepInfer's own draft_tok/accept_tok.
    env = engine_env("0,1,2,3,4,5,6,7")
    args = (str(checkpoint), "--ep", "1", "--speculative-tokens", "3")
    with LiveServer(*args, engine="deepinfer", env=env) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        }
        reply = client.chat.completions.create(
            model=str(checkpoint),
            messages=[{"role": "user", "content": '{"city": "Paris"}'}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "place", "schema": schema, "strict": True},
            },
            extra_body={"thinking": {"type": "disabled"}},
        )
        assert json.loads(reply.choices[0].message.content or "") == {"city": "Paris"}
        plain = client.chat.completions.create(
            model=str(checkpoint),
            messages=[{"role": "user", "content": "and now plain text"}],
            extra_body={"thinking": {"type": "disabled"}},
        )
        assert plain.choices[0].message.content == "and now plain text"
        exposition = httpx.get(server.base_url + "/metrics", timeout=10).text
        totals = {
            name: float(line.split()[-1])
            for line in exposition.splitlines()
            for name in ("draft_tokens", "accepted_tokens")
            if line.startswith(f"deepinfer:spec_decode_num_{name}_total{{")
        }
        assert 0 < totals["accepted_tokens"] < totals["draft_tokens"]


def _echo_with_logprobs(server: LiveServer, checkpoint: Path) -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/completions",
        json={
            "model": str(checkpoint),
            "prompt": "one two three",
            "max_tokens": 2,
            "echo": True,
            "logprobs": 1,
        },
        timeout=60,
    )


def test_echo_with_logprobs_is_refused_where_deepinfer_drops_prompt_logprobs(
    checkpoint: Path,
) -> None:
    env = engine_env("0")
    with LiveServer(str(checkpoint), "--ep", "1", engine="deepinfer", env=env) as server:
        reply = _echo_with_logprobs(server, checkpoint)
        assert reply.status_code == 200
        echoed = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert echoed[0] is None and all(value is not None for value in echoed[1:])
    # YoCo prefill truncation (DeepInfer's README recommends "compact") turns prompt
    # logprobs off inside add_request: the server says so instead of returning nulls.
    yoco = {
        **env,
        "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact",
        "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "64",
    }
    with LiveServer(str(checkpoint), "--ep", "1", engine="deepinfer", env=yoco) as server:
        reply = _echo_with_logprobs(server, checkpoint)
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == "echo"
        assert "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact" in error["message"]


def _png(width: int, height: int) -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 90)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def cached_server(checkpoint: Path) -> Iterator[LiveServer]:
    """One server with DeepInfer's engine and the server's prefix cache on its hooks."""
    env = engine_env("0")
    args = (str(checkpoint), "--ep", "1", "--enable-prefix-caching")
    with LiveServer(*args, engine="deepinfer", env=env) as server:
        yield server


def test_an_image_reaches_deepinfers_vision_input(
    checkpoint: Path, cached_server: LiveServer
) -> None:
    # deepseek-recipe renders <｜image｜> (129279); DeepInfer expands only the checkpoint's own
    # placeholder (here <｜deepseek_image｜>): any other ID passes as text, image ignored. The
    # prefix cache sends an image prompt down DeepInfer's own path.
    client = openai.OpenAI(base_url=cached_server.base_url + "/v1", api_key="x", max_retries=0)
    content: list[dict[str, object]] = [
        {"type": "image_url", "image_url": {"url": _png(300, 200)}},
        {"type": "text", "text": "what is this?"},
    ]
    reply = client.chat.completions.create(
        model=str(checkpoint),
        messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
        max_tokens=200,
        extra_body={"thinking": {"type": "disabled"}},
    )
    answer = reply.choices[0].message.content or ""
    assert answer.startswith("[image 1: "), answer
    assert answer.endswith("what is this?")


def _messages(server: LiveServer, checkpoint: Path, messages: list[Any]) -> dict[str, Any]:
    system = [
        {
            "type": "text",
            "text": " ".join(f"rule {number} keep answers short." for number in range(80)),
            "cache_control": {"type": "ephemeral", "ttl": "1h"},
        }
    ]
    reply = httpx.post(
        server.base_url + "/v1/messages",
        json={"model": str(checkpoint), "max_tokens": 16, "system": system, "messages": messages},
        headers={"anthropic-version": "2023-06-01"},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def test_a_cache_control_prompt_is_written_and_read_back_on_deepinfer(
    checkpoint: Path, cached_server: LiveServer
) -> None:
    # Claude Code's shape: a marked system prompt, then the next turn resends the conversation.
    turn1: list[Any] = [{"role": "user", "content": "list the files"}]
    first = _messages(cached_server, checkpoint, turn1)
    usage = first["usage"]
    assert usage["cache_read_input_tokens"] == 0
    assert usage["cache_creation_input_tokens"] > 300  # the whole prompt is written
    assert usage["input_tokens"] == 0
    assert (
        usage["cache_creation"]["ephemeral_1h_input_tokens"]
        == (usage["cache_creation_input_tokens"])
    )
    answer = "".join(block["text"] for block in first["content"] if block["type"] == "text")
    turn2 = [
        *turn1,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "open the first one"},
    ]
    second = _messages(cached_server, checkpoint, turn2)["usage"]
    assert second["cache_read_input_tokens"] >= usage["cache_creation_input_tokens"] - 1
    assert second["cache_creation_input_tokens"] > 0


def test_the_servers_image_token_count_is_deepinfers(checkpoint: Path) -> None:
    from deepinfer_server.model.images import deepinfer_image_policy

    policy = deepinfer_image_policy(checkpoint, (checkpoint / "tokenizer.json").read_text())
    assert policy.geometry is not None
    sizes = [(w, h) for w in (1, 13, 14, 300, 644, 1280, 4000) for h in (1, 7, 28, 476, 2000)]
    sizes += [(20000, 3), (3, 20000), (56, 56), (333, 4096)]
    counts = run_in_twin(
        checkpoint,
        f"""
        from deepinfer.hugging_face import build_mm_processor, load_processor_config
        from deepinfer.ve.processor.common import ImageInput
        processor = build_mm_processor(load_processor_config(CHECKPOINT)).image_processor
        RESULT = [
            processor.estimate_num_tokens(ImageInput(width=w, height=h, binary=None))
            for w, h in {sizes!r}
        ]
        """,
    )
    assert [policy.geometry.token_count(w, h) for w, h in sizes] == counts


def test_deepinfers_tokenizer_policy_takes_the_checkpoints_tokenizer(checkpoint: Path) -> None:
    # DeepInfer registers its 21 multimodal span tokens at 129280-129300 and refuses a
    # tokenizer that has anything there; <｜System｜> used to sit at 129280.
    result = run_in_twin(
        checkpoint,
        """
        tokenizer = ENGINE.tokenizer
        RESULT = {
            "system": tokenizer.convert_tokens_to_ids("<｜System｜>"),
            "spans": [tokenizer.convert_tokens_to_ids(f"<|place_holder_mm_span_{i:04d}|>")
                      for i in (0, 20)],
            "vocab_size": ENGINE.model_config.get_vocab_size(),
            "dropped": ENGINE.add_request("0", "high", {"max_tokens": 1},
                                          np.asarray([5, 129280], dtype=np.int32)) is None,
        }
        """,
    )
    assert result["system"] < result["vocab_size"] == 129280
    assert result["spans"] == [129280, 129300]
    assert result["dropped"]  # DeepInfer's own bound, which the server applies before admission


def test_speculative_decoding_on_deepinfers_scheduler(checkpoint: Path) -> None:
    """`--speculative-tokens` on DeepInfer's own code: with DEEPINFER_USE_NEXTN_DECODE=3 the
    twin's model proposes drafts and verifies them (`TwinModel.verify`), DeepInfer's scheduler
    appends the accepted ones with its per-token stop checks and its output pool emits several
    entries per request per step, read by the server's driver, which counts the drafts from
    the real `draft_tok`/`accept_tok`. The answers (an EOS, max_tokens inside a step, a regex
    grammar) are those without speculation, in fewer, larger steps."""
    body = """
        DRIVER = LLMEngineDriver(ENGINE, RequestOutput, ABILITIES, count_drafts=True)
        assert add("eos", "one two three four five six seven eight nine ten") is None
        assert add("length", "one two three four five six", max_tokens=6, ignore_eos=True) is None
        assert add("so", "abc def ghi", structured=StructuredOutput(
            schema_type="regex", schema="[a-z ]{1,40}"
        )) is None
        seen = {}
        for _ in range(2000):
            unfinished, deltas = DRIVER.iterate()
            for delta in deltas:
                entry = seen.setdefault(delta.request_id, {"tokens": [], "finish": None})
                entry["tokens"].append(delta.tokens.token_ids)
                if delta.finish is not None:
                    entry["finish"] = delta.finish.name
            if not unfinished and not deltas and DRIVER.num_live == 0:
                break
        counters = DRIVER.counters() or DRIVER._readouts._last_counters
        RESULT = {
            "run": {
                rid: {
                    "tokens": [t for step in e["tokens"] for t in step],
                    "finish": e["finish"],
                    "largest": max(len(step) for step in e["tokens"]),
                }
                for rid, e in seen.items()
            },
            "drafts": [
                counters.spec_drafts, counters.spec_draft_tokens, counters.spec_accepted_tokens
            ],
        }
        RESULT["text"] = {rid: text_of(e["tokens"]) for rid, e in RESULT["run"].items()}
        """
    # One grammar thread, unbound: this node has fewer cores than DeepInfer's default needs.
    grammar = {"DEEPINFER_SO_BUILDER_CPUS": "0"}
    plain = run_in_twin(checkpoint, body, env=grammar)
    speculative = run_in_twin(checkpoint, body, env={**grammar, "DEEPINFER_USE_NEXTN_DECODE": "3"})
    answers = {rid: (e["tokens"], e["finish"]) for rid, e in speculative["run"].items()}
    assert answers == {rid: (e["tokens"], e["finish"]) for rid, e in plain["run"].items()}
    assert speculative["text"]["eos"] == "one two three four five six seven eight nine ten"
    assert answers["length"][1] == "LENGTH" and len(answers["length"][0]) == 6
    assert speculative["text"]["so"] == "abc def ghi"
    assert {rid: e["largest"] for rid, e in plain["run"].items()} == dict.fromkeys(answers, 1)
    assert all(e["largest"] > 1 for e in speculative["run"].values())
    drafts, draft_tokens, accepted = speculative["drafts"]
    assert plain["drafts"] == [0, 0, 0]
    assert draft_tokens == 3 * drafts and 0 < accepted < draft_tokens

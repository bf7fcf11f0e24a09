"""Chat Completions preparation and output shaping, in-process with the real deepseek-recipe."""

from __future__ import annotations

from functools import cache
from typing import Any

import orjson
import pytest

from deepinfer_server.errors import BadRequestError, ModelNotFoundError
from deepinfer_server.ipc.messages import Finish, GeneratedTokens
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from deepinfer_server.protocol.chat.output import ChatOutput
from deepinfer_server.protocol.chat.request import prepare_chat
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.validation import decode_json

PNG_DATA_URL = "data:image/png;base64,iVBORw0KGgo="


@cache
def recipe() -> RecipeContext:
    return RecipeContext.create(embedded_tokenizer_json(), ("flash",), 4096, default_thinking=True)


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "flash", "messages": [{"role": "user", "content": "hi"}], **extra}


def tokens(ids: list[int]) -> GeneratedTokens:
    return GeneratedTokens(list(ids))


def run_stream(
    extra: dict[str, Any], text: str, reason: Finish = Finish.STOP
) -> list[dict[str, Any]]:
    prepared = prepare_chat(body(stream=True, thinking={"type": "disabled"}, **extra), recipe())
    output = ChatOutput(prepared, "chatcmpl-test", recipe())
    payloads = output.start()
    for token in recipe().tokenizer.encode(text):
        payloads += output.push(tokens([token]))
    payloads += output.finish(reason)
    output.close()
    return [orjson.loads(p) for p in payloads]


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert prepare_chat(body(max_completion_tokens=7), recipe()).sampling.max_tokens == 7
    assert (
        prepare_chat(body(max_tokens=9, max_completion_tokens=7), recipe()).sampling.max_tokens == 7
    )
    assert prepare_chat(body(max_tokens=9), recipe()).sampling.max_tokens == 9


def test_default_max_tokens_is_lowered_to_the_context_left() -> None:
    prepared = prepare_chat(body(), recipe())
    assert prepared.sampling.max_tokens == 4096 - len(prepared.prompt_token_ids)


def test_sampling_options_reach_the_engine_request() -> None:
    prepared = prepare_chat(
        body(temperature=0.3, top_p=0.5, seed=42, ignore_eos=True, thinking={"type": "disabled"}),
        recipe(),
    )
    sampling = prepared.sampling
    assert (sampling.temperature, sampling.seed, sampling.ignore_eos) == (
        pytest.approx(0.3),
        42,
        True,
    )
    # The recipe resolves the final top_p for the model version; the server passes that on.
    assert sampling.top_p == prepared.request.inference_options.top_p


def test_prompt_starts_with_a_single_bos() -> None:
    ids = prepare_chat(body(), recipe()).prompt_token_ids
    assert ids[0] == 0 and ids.count(0) == 1


def test_default_thinking_can_be_disabled() -> None:
    no_thinking = RecipeContext.create(
        embedded_tokenizer_json(), ("flash",), 4096, default_thinking=False
    )
    prepared = prepare_chat(body(), no_thinking)
    assert prepared.request.parsing_options.thinking_initial_stage is None
    assert prepare_chat(body(), recipe()).request.parsing_options.thinking_initial_stage is not None


def test_usage_only_on_an_extra_final_chunk_when_asked() -> None:
    chunks = run_stream({"stream_options": {"include_usage": True}}, "Hello world")
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_no_usage_anywhere_when_not_asked() -> None:
    chunks = run_stream({}, "Hello world", reason=Finish.LENGTH)
    assert all("usage" in c and c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_continuous_usage_on_every_chunk() -> None:
    chunks = run_stream(
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "a b c"
    )
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion[0] == 0 and completion == sorted(completion)
    assert chunks[-1]["choices"] == []


def test_eos_free_stop_sequence_finishes_the_parser() -> None:
    prepared = prepare_chat(body(stop=["gamma"], thinking={"type": "disabled"}), recipe())
    output = ChatOutput(prepared, "chatcmpl-x", recipe())
    output.start()
    output.push(tokens(recipe().tokenizer.encode("alpha beta gamma delta")))
    assert output.finished
    output.finish(Finish.STOP)
    result = orjson.loads(output.response_json())
    assert result["choices"][0]["message"]["content"] == "alpha beta "


def _answer(
    extra: dict[str, Any], batches: list[list[int]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(streamed chunks, non-streamed body) for the same token batches, without `created`."""
    streamed: list[dict[str, Any]] = []
    body_json: dict[str, Any] = {}
    for stream in (True, False):
        options = {"stream_options": {"include_usage": True}} if stream else {}
        prepared = prepare_chat(
            body(stream=stream, thinking={"type": "disabled"}, **options, **extra), recipe()
        )
        output = ChatOutput(prepared, "chatcmpl-x", recipe())
        payloads = output.start()
        for batch in batches:
            if output.finished:
                break
            payloads += output.push(tokens(batch))
        payloads += output.finish(Finish.STOP)
        output.close()
        if stream:
            streamed = [orjson.loads(payload) for payload in payloads]
        else:
            body_json = orjson.loads(output.response_json())
    for part in [*streamed, body_json]:
        part.pop("created")
    return streamed, body_json


def test_a_stop_inside_a_batch_counts_and_renders_only_the_tokens_before_it() -> None:
    # Several tokens at once (speculative decoding, --stream-interval) must answer as one
    # token per step does: the tokens after the stop are neither shown nor counted.
    ids = recipe().tokenizer.encode("alpha beta gamma delta epsilon zeta")
    extra = {"stop": ["gamma"]}
    one_by_one, whole_one = _answer(extra, [[token] for token in ids])
    batched, whole_batched = _answer(extra, [ids])
    assert batched == one_by_one
    assert whole_batched == whole_one
    assert whole_one["choices"][0]["message"]["content"] == "alpha beta "
    assert whole_one["usage"]["completion_tokens"] == 3
    assert one_by_one[-1]["usage"]["completion_tokens"] == 3


def test_a_batch_without_a_stop_makes_one_chunk() -> None:
    ids = recipe().tokenizer.encode("alpha beta gamma")
    one_by_one, whole_one = _answer({}, [[token] for token in ids])
    batched, whole_batched = _answer({}, [ids])
    assert len(batched) == len(one_by_one) - 2  # three content chunks became one
    assert whole_batched == whole_one


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"presence_penalty": 1}, "presence_penalty"),
        ({"top_k": 0.5}, "top_k"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"max_completion_tokens": True}, "max_completion_tokens"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": PNG_DATA_URL}}],
                    }
                ]
            },
            "messages[0]",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "a", "reasoning_content": "thought"},
                    {"role": "assistant", "content": "b", "reasoning_content": [{"x": 1}]},
                ]
            },
            "messages[2].reasoning_content",
        ),
    ],
)
def test_server_side_rejections_name_the_param(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequestError) as excinfo:
        prepare_chat(body(**extra), recipe())
    assert excinfo.value.param == param
    assert excinfo.value.status_code == 400


def test_unknown_model_is_model_not_found() -> None:
    with pytest.raises(ModelNotFoundError) as excinfo:
        prepare_chat(body(model="DeepSeek-V4-Pro"), recipe())
    assert excinfo.value.status_code == 404 and excinfo.value.code == "model_not_found"


@pytest.mark.parametrize("raw", [b"{", b"\xff", b'"\\udc00"', b"3"])
def test_undecodable_bodies(raw: bytes) -> None:
    with pytest.raises(BadRequestError):
        decode_json(raw)

"""POST /v1/completions and n > 1 with the official openai client against a live server.

The simulated engine continues a prompt that has no chat turn with the prompt's own text.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.conftest import MODEL
from tests.server import LiveServer


def test_text_completion(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=20)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    choice = completion.choices[0]
    assert choice.text == "The quick brown fox" and choice.finish_reason == "stop"
    assert completion.usage is not None
    # BOS + four tokens: no chat template.
    assert completion.usage.prompt_tokens == 5 and completion.usage.completion_tokens == 4


def test_max_tokens_and_stop(client: openai.OpenAI) -> None:
    short = client.completions.create(model=MODEL, prompt="one two three four", max_tokens=2)
    assert short.choices[0].text == "one two" and short.choices[0].finish_reason == "length"
    stopped = client.completions.create(
        model=MODEL, prompt="one two three four", max_tokens=20, stop=[" three"]
    )
    assert stopped.choices[0].text == "one two" and stopped.choices[0].finish_reason == "stop"


def test_echo_with_logprobs_reports_prompt_and_completion_logprobs(
    client: openai.OpenAI,
) -> None:
    completion = client.completions.create(
        model=MODEL, prompt="alpha beta", max_tokens=5, echo=True, logprobs=2
    )
    choice = completion.choices[0]
    assert choice.text == "alpha betaalpha beta"
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    prompt_tokens = completion.usage.prompt_tokens  # type: ignore[union-attr]
    generated = completion.usage.completion_tokens  # type: ignore[union-attr]
    assert len(logprobs.tokens) == prompt_tokens + generated
    assert logprobs.token_logprobs is not None and logprobs.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in logprobs.token_logprobs[1:])
    assert logprobs.top_logprobs is not None
    assert all(len(top) <= 2 for top in logprobs.top_logprobs[prompt_tokens:] if top)
    offsets = logprobs.text_offset
    assert offsets is not None and offsets == sorted(offsets)
    for token, offset in zip(logprobs.tokens[1:], offsets[1:], strict=True):
        assert choice.text[offset:].startswith(token)  # offsets point into the text


def test_echo_with_max_tokens_zero_scores_the_prompt(client: openai.OpenAI) -> None:
    """What lm-eval's loglikelihood requests send."""
    completion = client.completions.create(
        model=MODEL, prompt="score this prompt", max_tokens=0, echo=True, logprobs=1
    )
    choice = completion.choices[0]
    assert choice.text == "score this prompt"
    values = choice.logprobs.token_logprobs  # type: ignore[union-attr]
    assert values is not None and values[0] is None
    assert len(values) == completion.usage.prompt_tokens  # type: ignore[union-attr]
    assert math.fsum(v for v in values[1:] if v is not None) < 0
    assert completion.usage.completion_tokens == 0  # type: ignore[union-attr]


def test_token_id_prompt_and_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt=[0, 19923, 2058],  # BOS "Hello" " world"
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        else:
            usage = chunk.usage
    assert text == "Hello world"
    assert usage is not None and usage.prompt_tokens == 3 and usage.completion_tokens == 2


def test_n_choices_and_prompt_lists(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt=["red", "green"], n=2, max_tokens=3, seed=1
    )
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert [c.text for c in completion.choices] == ["red", "red", "green", "green"]


def test_chat_n_three_choices_with_summed_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "three choices"}]
    one = client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    three = client.chat.completions.create(model=MODEL, messages=messages, n=3)  # type: ignore[arg-type]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.message.content == "three choices" for c in three.choices)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # type: ignore[union-attr]
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "presence_penalty": 1}, "presence_penalty"),
        ({"prompt": "word " * 5000, "max_tokens": 10}, "prompt"),
        ({"prompt": "x", "temperature": 3}, "temperature"),
    ],
)
def test_bad_completion_requests_name_the_param(
    client: openai.OpenAI, body: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.post(
            "/completions",
            body={"model": MODEL, **body},
            cast_to=object,  # type: ignore[arg-type]
        )
    assert caught.value.body["param"] == param  # type: ignore[index]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"input": "x", "n": 2}),
        ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "n": 2}),
    ],
)
def test_responses_and_messages_have_no_n(
    shared_server: LiveServer, path: str, body: dict[str, object]
) -> None:
    response = httpx.post(shared_server.base_url + path, json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert "'n'" in response.text


@pytest.mark.parametrize("stream", [False, True])
def test_ignore_eos_usage_counts_every_generated_token(client: openai.OpenAI, stream: bool) -> None:
    # The echo ends in EOS after a few tokens; under ignore_eos that EOS is generated as an
    # ordinary token: counted in usage, never rendered.
    kwargs = {"model": MODEL, "prompt": "one two", "max_tokens": 12}
    extra = {"ignore_eos": True}
    if stream:
        chunks = list(
            client.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=extra
            )
        )
        usage = chunks[-1].usage
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    else:
        completion = client.completions.create(**kwargs, extra_body=extra)
        usage, text = completion.usage, completion.choices[0].text
    assert usage is not None and usage.completion_tokens == 12
    assert "<｜end▁of▁sentence｜>" not in text

"""Logprobs, top_k and unsupported sampling parameters with the official openai client."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import MODEL

NO_THINKING = {"thinking": {"type": "disabled"}}
PROMPT = [{"role": "user", "content": "Logprobs are reported per token."}]


def test_chat_logprobs_one_entry_per_content_token(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=PROMPT, logprobs=True, top_logprobs=3, extra_body=NO_THINKING
    )
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert response.usage is not None and len(entries) == response.usage.completion_tokens
    assert "".join(entry.token for entry in entries) == choice.message.content
    for entry in entries:
        assert entry.logprob <= 0.0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.logprob in values  # the sampled token is among its alternatives


def test_chat_logprobs_stream_matches_the_content(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=PROMPT, logprobs=True, stream=True, extra_body=NO_THINKING
    )
    content, tokens = "", ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0]
        content += delta.delta.content or ""
        if delta.logprobs is not None and delta.logprobs.content:
            assert all(entry.top_logprobs == [] for entry in delta.logprobs.content)
            tokens += "".join(entry.token for entry in delta.logprobs.content)
    assert content == "Logprobs are reported per token." == tokens


def test_chat_without_logprobs_reports_none(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=PROMPT, extra_body=NO_THINKING)
    assert response.choices[0].logprobs is None


def test_responses_include_output_text_logprobs(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="Responses report logprobs.",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        reasoning={"effort": "none"},
    )
    text = response.output[-1].content[0]  # type: ignore[union-attr]
    assert text.logprobs is not None  # type: ignore[union-attr]
    assert "".join(entry.token for entry in text.logprobs) == text.text  # type: ignore[union-attr]
    assert all(len(entry.top_logprobs) == 2 for entry in text.logprobs)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
        ("repetition_penalty", 1.2),
        ("min_p", 0.05),
        ("logit_bias", {"19923": 5}),
    ],
)
def test_parameters_the_engine_cannot_apply_are_400(
    client: openai.OpenAI, param: str, value: object
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=PROMPT, extra_body={param: value})
    assert caught.value.body["param"] == param  # type: ignore[index]
    assert "not supported" in caught.value.body["message"]  # type: ignore[index]


def test_neutral_values_and_top_k_are_accepted(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=PROMPT,
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
        extra_body={**NO_THINKING, "repetition_penalty": 1, "min_p": 0, "top_k": 20},
    )
    assert response.choices[0].message.content == "Logprobs are reported per token."


@pytest.mark.parametrize("body", [{"top_k": -2}, {"top_k": "5"}, {"top_logprobs": 21}])
def test_bad_top_k_and_top_logprobs_name_the_param(client: openai.OpenAI, body: dict) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=PROMPT, extra_body={"logprobs": True, **body}
        )
    assert caught.value.body["param"] == next(iter(body))  # type: ignore[index]

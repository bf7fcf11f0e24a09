"""PromptEncoder: an agent's next turn encoded from its last one gives exactly deepseek-recipe's
tokens (tool loops, new user turns, thinking turns that drop `<think>`, special-token spellings
in user text, tools declared or not); where it cannot tell, the recipe encodes; a disagreement
turns reuse off."""

from __future__ import annotations

import random
from functools import cache
from typing import Any

import pytest
import tokenizers
from deepseek_recipe import ChatCompletionRequest, Conversation

from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from deepinfer_server.protocol.core import prompt_encoder as module
from deepinfer_server.protocol.core.prompt_encoder import PromptEncoder, common_prefix_length
from deepinfer_server.protocol.core.recipe import RecipeContext

SPECIALS = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜end▁of▁sentence｜>",
    "｜DSML｜",
]
PROSE = (
    "the agent reads a file and edits it then runs the tests 42 times over 中文 テキスト "
    "with some punctuation: (a), [b]; {c}! and\nnew lines\n\n  indented code = x + 1"
)
WORDS = PROSE.split(" ")
TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}


@cache
def recipe() -> RecipeContext:
    return RecipeContext.create(embedded_tokenizer_json(), ("flash",), 65536, default_thinking=True)


def _encoder(**kwargs: Any) -> PromptEncoder:
    tokenizer = tokenizers.Tokenizer.from_str(embedded_tokenizer_json())
    return PromptEncoder(tokenizer, **{"check_every": 10**9, **kwargs})


def _text(rng: random.Random, words: int, specials: bool) -> str:
    picked = [rng.choice(WORDS) for _ in range(words)]
    if specials and rng.random() < 0.5:
        picked.insert(rng.randrange(len(picked) + 1), rng.choice(SPECIALS))
    return " ".join(picked)


def _conversation(messages: list[dict[str, Any]], thinking: bool, tools: bool) -> Conversation:
    body: dict[str, Any] = {
        "model": "flash",
        "messages": messages,
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    if tools:
        body["tools"] = [TOOL]
    return ChatCompletionRequest(body).convert(recipe().options).conversation


def _turns(seed: int, count: int) -> list[Conversation]:
    """An agent conversation's successive prompts: a long system prompt, then user turns,
    answers (with reasoning in thinking mode) and tool calls with their results."""
    rng = random.Random(seed)
    thinking, tools = rng.random() < 0.5, rng.random() < 0.5
    messages: list[dict[str, Any]] = [{"role": "system", "content": _text(rng, 2500, False)}]
    prompts = []
    for turn in range(count):
        messages.append({"role": "user", "content": _text(rng, rng.randrange(5, 200), True)})
        prompts.append(_conversation(messages, thinking, tools))
        answer: dict[str, Any] = {"role": "assistant", "content": _text(rng, 60, True)}
        if thinking:
            answer["reasoning_content"] = _text(rng, 30, False)
        if tools and rng.random() < 0.6:
            call = {
                "id": f"call_{turn}",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
            }
            messages.append({**answer, "tool_calls": [call]})
            content = _text(rng, rng.randrange(5, 300), True)
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": content})
            prompts.append(_conversation(messages, thinking, tools))  # the tool loop's turn
            messages.append({"role": "assistant", "content": _text(rng, 20, False)})
        else:
            messages.append(answer)
    return prompts


@pytest.mark.parametrize("seed", range(8))
def test_every_turn_encodes_exactly_as_the_recipe_does_and_reuses_the_last(seed: int) -> None:
    encoder = _encoder()
    encoding = recipe().encoding
    prompts = _turns(seed, 6)
    for number, conversation in enumerate(prompts):
        assert encoder.encode(encoding, conversation) == encoding.encode(conversation), number
    assert encoder.enabled
    assert encoder._reuses == len(prompts) - 1  # every turn after the first reused its last


def test_a_thinking_turn_reuses_up_to_the_assistant_token_before_the_dropped_think() -> None:
    encoder = _encoder()
    encoding = recipe().encoding
    system = {"role": "system", "content": " ".join(WORDS * 300)}
    first = _conversation([system, {"role": "user", "content": "one"}], True, False)
    later = [
        system,
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "thought"},
        {"role": "user", "content": "two"},
    ]
    second = _conversation(later, True, False)
    assert encoding.render_conversation(first).prompt.endswith("<｜Assistant｜><think>")
    assert not encoding.render_conversation(second).prompt.startswith(
        encoding.render_conversation(first).prompt
    )  # not a byte prefix: the earlier prompt's <think> is gone
    encoder.encode(encoding, first)
    assert encoder.encode(encoding, second) == encoding.encode(second)
    assert encoder._reuses == 1


def test_the_same_text_with_a_special_token_as_plain_text_is_cut_before_it() -> None:
    encoder = _encoder()
    encoding = recipe().encoding
    system = {"role": "system", "content": " ".join(WORDS * 300)}
    # The earlier turn's answer and the next turn's user text render the same characters,
    # but only one holds <｜User｜> as a special token.
    first = _conversation(
        [
            system,
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
        False,
        False,
    )
    text = encoding.render_conversation(first).prompt
    assistant_at = text.rindex("b")
    spelled = text[
        assistant_at:
    ]  # "b<｜end▁of▁sentence｜><｜User｜>c<｜Assistant｜>..." as plain text
    second = _conversation(
        [system, {"role": "user", "content": "a"}, {"role": "assistant", "content": spelled}],
        False,
        False,
    )
    encoder.encode(encoding, first)
    assert encoder.encode(encoding, second) == encoding.encode(second)
    assert encoder._reuses == 1  # up to a special token both render as one


def test_short_prompts_are_encoded_whole_and_not_kept() -> None:
    encoder = _encoder()
    conversation = _conversation([{"role": "user", "content": "hi"}], False, False)
    assert encoder.encode(recipe().encoding, conversation) == recipe().encoding.encode(conversation)
    assert not encoder._entries


def test_a_disagreement_with_the_recipe_turns_reuse_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    encoder = _encoder(check_every=1)
    encoding = recipe().encoding
    prompts = _turns(3, 3)
    encoder.encode(encoding, prompts[0])
    monkeypatch.setattr(encoder, "_plain", lambda span: [5] * len(span))  # a wrong encoder
    assert encoder.encode(encoding, prompts[1]) == encoding.encode(prompts[1])
    assert not encoder.enabled and not encoder._entries
    assert "prompt encoding reuse disagreed" in caplog.text
    assert encoder.encode(encoding, prompts[2]) == encoding.encode(prompts[2])


def test_entries_beyond_the_byte_bound_are_dropped_oldest_first() -> None:
    encoder = _encoder(max_bytes=1)
    encoding = recipe().encoding
    for seed in range(3):
        encoder.encode(encoding, _turns(seed, 1)[0])
    assert len(encoder._entries) <= 1 and encoder._bytes <= max(
        (sum(e.size for e in entries) for entries in encoder._entries.values()), default=0
    )


def test_common_prefix_length_across_chunks() -> None:
    a = "x" * (3 * module._CHUNK + 17) + "tail"
    assert common_prefix_length(a, a) == len(a)
    assert common_prefix_length(a, a[:-2] + "ZZ") == len(a) - 2
    assert common_prefix_length(a, "y" + a) == 0
    assert common_prefix_length(a, a[:100]) == 100

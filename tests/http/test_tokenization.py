"""vLLM's tokenizer endpoints (`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`), as
evaluation tools use them (lm-eval's remote tokenizer probes `/tokenizer_info`, then encodes the
EOS token with `/tokenize`): the real tokenizer, and for `messages` the rendering Chat uses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from deepinfer_server.model.tokenizer import embedded_tokenizer_json, load_tokenizer_config
from deepinfer_server.model.tokens import BOS_TOKEN, EOS_TOKEN
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.tokenization.request import tokenizer_info
from tests.http.harness import MODEL, Harness, run, serve

CONTEXT = 4096  # the harness's --max-model-len
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
]


async def _post(h: Harness, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await h.client.post(path, json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def _validate(h: Harness, answer: dict[str, Any], component: str) -> None:
    document = (await h.client.get("/openapi.json")).json()
    schema = {"$ref": f"#/components/schemas/{component}", **document}
    jsonschema.Draft202012Validator(schema).validate(answer)


def test_messages_count_is_the_chat_requests_prompt() -> None:
    async def body() -> None:
        async with serve() as h:
            for extra in ({}, {"tools": [TOOL]}, {"thinking": {"type": "disabled"}}):
                tokenized = await _post(
                    h, "/tokenize", {"model": MODEL, "messages": CONVERSATION, **extra}
                )
                chat = {"model": MODEL, "messages": CONVERSATION, "max_tokens": 8, **extra}
                answer = await _post(h, "/v1/chat/completions", chat)
                _, prompt, _ = h.coordinator.submitted[-1]
                assert tokenized["tokens"] == prompt, extra
                assert tokenized["count"] == answer["usage"]["prompt_tokens"] == len(prompt)
                assert tokenized["max_model_len"] == CONTEXT
                assert tokenized["token_strs"] is None
                await _validate(h, tokenized, "TokenizeResponse")

    run(body)


def test_a_prompt_is_encoded_as_completions_encode_it() -> None:
    async def body() -> None:
        async with serve() as h:
            text = "The capital of France is"
            tokenized = await _post(h, "/tokenize", {"prompt": text, "return_token_strs": True})
            await _post(h, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
            assert tokenized["tokens"] == h.coordinator.submitted[-1][1]
            assert tokenized["token_strs"][0] == BOS_TOKEN
            assert len(tokenized["token_strs"]) == tokenized["count"]
            bare = await _post(h, "/tokenize", {"prompt": text, "add_special_tokens": False})
            assert bare["tokens"] == tokenized["tokens"][1:]
            # Back to the text, special tokens kept, as vLLM decodes.
            back = await _post(h, "/detokenize", {"model": MODEL, "tokens": tokenized["tokens"]})
            assert back == {"prompt": BOS_TOKEN + text}
            await _validate(h, back, "DetokenizeResponse")

    run(body)


def test_tokenizer_info_gives_the_special_tokens_lm_eval_reads() -> None:
    async def body() -> None:
        async with serve() as h:
            info = (await h.client.get("/tokenizer_info")).json()
            assert info["eos_token"] == EOS_TOKEN and info["bos_token"] == BOS_TOKEN
            assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
            await _validate(h, info, "TokenizerInfo")
            # lm-eval's eos_token_id: the EOS token encoded without special tokens added.
            eos = await _post(h, "/tokenize", {"prompt": EOS_TOKEN, "add_special_tokens": False})
            assert eos["count"] == 1
            assert (await _post(h, "/detokenize", {"tokens": eos["tokens"]}))["prompt"] == EOS_TOKEN

    run(body)


def test_continue_final_message_continues_the_assistant_turn() -> None:
    async def body() -> None:
        async with serve() as h:
            messages = [*CONVERSATION, {"role": "assistant", "content": "It is"}]
            request = {
                "messages": messages,
                "continue_final_message": True,
                "add_generation_prompt": False,
                "thinking": {"type": "disabled"},
            }
            tokenized = await _post(h, "/tokenize", request)
            text = (await _post(h, "/detokenize", {"tokens": tokenized["tokens"]}))["prompt"]
            assert text.endswith("It is"), text
            # DeepSeek's own spelling of a continued message renders the same prompt.
            prefixed = [*CONVERSATION, {"role": "assistant", "content": "It is", "prefix": True}]
            chat = {"model": MODEL, "messages": prefixed, "thinking": {"type": "disabled"}}
            await _post(h, "/v1/chat/completions", {**chat, "max_tokens": 4})
            assert h.coordinator.submitted[-1][1] == tokenized["tokens"]

    run(body)


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"prompt": "x", "messages": CONVERSATION}, 400, "messages", None),
        ({}, 400, "prompt", None),
        ({"prompt": 3}, 400, "prompt", None),
        ({"prompt": "x", "temperature": 1}, 400, "temperature", None),
        ({"prompt": "x", "model": "nope"}, 404, "model", "model_not_found"),
        (
            {"messages": CONVERSATION, "add_generation_prompt": False},
            400,
            "add_generation_prompt",
            "unsupported_parameter",
        ),
        (
            {
                "messages": CONVERSATION,
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
            400,
            "continue_final_message",
            None,
        ),
        (
            {"messages": CONVERSATION, "continue_final_message": True},
            400,
            "continue_final_message",
            None,
        ),
        ({"messages": CONVERSATION, "chat_template": "{{ x }}"}, 400, "chat_template", None),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                        ],
                    }
                ]
            },
            400,
            "messages",
            "unsupported_parameter",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": "a", "reasoning_content": "x"},
                    {"role": "assistant", "content": "b", "reasoning_content": [{"x": 1}]},
                ]
            },
            400,
            "messages[1].reasoning_content",
            None,
        ),
    ],
    ids=[
        "both",
        "neither",
        "prompt-not-text",
        "unknown-field",
        "unknown-model",
        "no-generation-prompt",
        "both-prompts",
        "continue-a-user-message",
        "chat-template",
        "bad-role",
        "image",
        "reasoning-not-text",
    ],
)
def test_bad_tokenize_requests_are_400s_in_openais_envelope(
    body: dict[str, Any], status: int, param: str | None, code: str | None
) -> None:
    async def run_it() -> None:
        async with serve() as h:
            response = await h.client.post("/tokenize", json=body)
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["message"]
            if param is not None:
                assert error["param"] == param, error
            if code is not None:
                assert error["code"] == code, error

    run(run_it)


@pytest.mark.parametrize("tokens", [[1, -1], [1, 10**9], [1, "2"], [True], "1 2", None])
def test_bad_detokenize_requests_name_the_tokens(tokens: Any) -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.post("/detokenize", json={"tokens": tokens})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "tokens"

    run(body)


def test_the_tokenizer_endpoints_need_a_key_when_keys_are_configured() -> None:
    async def body() -> None:
        async with serve("--api-key", "secret") as h:
            calls = [
                ("POST", "/tokenize", {"prompt": "x"}),
                ("POST", "/detokenize", {"tokens": [1]}),
                ("GET", "/tokenizer_info", None),
            ]
            for method, path, payload in calls:
                refused = await h.client.request(method, path, json=payload)
                assert refused.status_code == 401, path
                assert refused.json()["error"]["code"] == "invalid_api_key"
                key = {"Authorization": "Bearer secret"}
                accepted = await h.client.request(method, path, json=payload, headers=key)
                assert accepted.status_code == 200, path

    run(body)


def test_tokenizer_info_is_the_checkpoints_config_without_file_paths(tmp_path: Path) -> None:
    config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": BOS_TOKEN, "lstrip": False},
        "eos_token": EOS_TOKEN,
        "vocab_file": "/somewhere/vocab.json",
        "model_max_length": 131072,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    recipe = RecipeContext.create(
        embedded_tokenizer_json(),
        (MODEL,),
        CONTEXT,
        default_thinking=True,
        tokenizer_config=load_tokenizer_config(str(tmp_path)),
    )
    assert tokenizer_info(recipe) == {
        "tokenizer_class": "LlamaTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": 131072,
    }
    assert load_tokenizer_config(str(tmp_path / "missing"))["eos_token"] == EOS_TOKEN

"""vLLM's tokenizer endpoints with the request and response shapes vLLM accepts and answers.

`POST /tokenize` takes a `prompt` (encoded as legacy Completions encodes one) or Chat `messages`
(rendered by deepseek-recipe exactly as `/v1/chat/completions` renders them, so `count` is that
request's `prompt_tokens`); `POST /detokenize` turns token IDs back into text;
`GET /tokenizer_info` is the tokenizer's configuration (evaluation tools such as lm-eval read its
special tokens). Errors are 400s naming the field, in OpenAI's envelope.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepinfer_server.errors import BadRequestError, ErrorKind
from deepinfer_server.protocol.chat.request import convert_chat, read_chat_body, recipe_body
from deepinfer_server.protocol.completions.request import text_prompt
from deepinfer_server.protocol.core.images import image_sources
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.recipe import RecipeContext, recipe_errors
from deepinfer_server.protocol.core.validation import check_chat_fields, check_model, optional_bool

#: vLLM's own fields of a `messages` request; the others are Chat Completions fields.
_CHAT_TOKENIZE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "return_token_strs",
)
#: vLLM fields that steer a Jinja chat template or a multimodal processor: deepseek-recipe
#: renders the prompt, so none of them can be honoured.
_TEMPLATE_FIELDS = (
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "media_io_kwargs",
)
#: What a `prompt` request may hold (vLLM's TokenizeCompletionRequest).
_PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
#: Configuration fields vLLM leaves out of `/tokenizer_info`: file paths.
_FILE_FIELDS = frozenset({"vocab_file", "merges_file", "tokenizer_file"})


def tokenize(body: JsonObject, recipe: RecipeContext) -> JsonObject:
    """vLLM's TokenizeResponse for a decoded `/tokenize` body: `count`, `max_model_len`,
    `tokens` and `token_strs` (null unless `return_token_strs`)."""
    if body.get("model") is not None:
        check_model(body, recipe.served_model_names)
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise BadRequestError(
            "send either 'prompt' (a string) or 'messages' (Chat Completions messages)",
            param="messages" if has_messages else "prompt",
        )
    token_strs = optional_bool(body, "return_token_strs")
    ids = _chat_tokens(body, recipe) if has_messages else _prompt_tokens(body, recipe)
    return {
        "count": len(ids),
        "max_model_len": recipe.context_limit,
        "tokens": ids,
        "token_strs": [recipe.decoder.id_to_token(i) for i in ids] if token_strs else None,
    }


def _prompt_tokens(body: JsonObject, recipe: RecipeContext) -> list[int]:
    unknown = sorted(set(body) - _PROMPT_FIELDS)
    if unknown:
        raise BadRequestError(
            f"'{unknown[0]}' is not a field of a 'prompt' tokenize request (model, prompt, "
            "add_special_tokens, return_token_strs)",
            param=unknown[0],
        )
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise BadRequestError("'prompt' must be a string", param="prompt")
    if optional_bool(body, "add_special_tokens", default=True):
        ids, _ = text_prompt(prompt, recipe)  # as legacy Completions encodes it: BOS first
        return ids
    return list(recipe.tokenizer.encode(prompt))


def _chat_tokens(body: JsonObject, recipe: RecipeContext) -> list[int]:
    _reject_template_fields(body)
    continue_final = _continues_final_message(body)
    fields = {k: v for k, v in body.items() if k not in _CHAT_TOKENIZE_FIELDS}
    chat = {"model": recipe.model_name, **fields}
    check_chat_fields(chat)
    converted, _ = convert_chat(
        _continued(recipe_body(chat, read_chat_body(chat)), continue_final), recipe
    )
    if image_sources(converted):
        raise BadRequestError(
            "images are not supported by /tokenize: their token count depends on the decoded "
            "image (send the request to /v1/chat/completions)",
            param="messages",
            kind=ErrorKind.UNSUPPORTED,
        )
    with recipe_errors():
        return recipe.encode(converted.conversation)


def _reject_template_fields(body: JsonObject) -> None:
    for name in _TEMPLATE_FIELDS:
        if body.get(name) is not None:
            raise BadRequestError(
                f"'{name}' is not supported: deepseek-recipe renders the conversation, as for "
                "/v1/chat/completions",
                param=name,
                kind=ErrorKind.UNSUPPORTED,
            )


def _continues_final_message(body: JsonObject) -> bool:
    """Whether the last (assistant) message is continued rather than answered."""
    generation_prompt = body.get("add_generation_prompt")
    continue_final = optional_bool(body, "continue_final_message")
    optional_bool(body, "add_special_tokens")  # the rendering starts with BOS either way
    if generation_prompt is not None and not isinstance(generation_prompt, bool):
        raise BadRequestError(
            "'add_generation_prompt' must be a boolean", param="add_generation_prompt"
        )
    if continue_final and generation_prompt:
        raise BadRequestError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    if generation_prompt is False and not continue_final:
        raise BadRequestError(
            "'add_generation_prompt': false is not supported: deepseek-recipe always opens the "
            "assistant's turn after the last message (continue_final_message continues a final "
            "assistant message instead)",
            param="add_generation_prompt",
            kind=ErrorKind.UNSUPPORTED,
        )
    return continue_final


def _continued(chat: JsonObject, continue_final: bool) -> JsonObject:
    """The recipe's body with its last assistant message continued (DeepSeek's own spelling of
    continue_final_message: `prefix`)."""
    if not continue_final:
        return chat
    *earlier, last = chat["messages"]
    if last.get("role") != "assistant":
        raise BadRequestError(
            "continue_final_message needs an assistant message last",
            param="continue_final_message",
        )
    return {**chat, "messages": [*earlier, {**last, "prefix": True}]}


def detokenize(body: JsonObject, recipe: RecipeContext) -> JsonObject:
    """vLLM's DetokenizeResponse, `{"prompt": text}`: the tokens decoded with special tokens
    kept, as vLLM decodes them."""
    if body.get("model") is not None:
        check_model(body, recipe.served_model_names)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise BadRequestError("'tokens' must be an array of token IDs", param="tokens")
    bound = recipe.decoder.get_vocab_size(with_added_tokens=True)
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < bound:
            raise BadRequestError(
                f"'tokens' holds {token!r}: token IDs are integers in [0, {bound})",
                param="tokens",
            )
    return {"prompt": recipe.decoder.decode(tokens, skip_special_tokens=False)}


def tokenizer_info(recipe: RecipeContext) -> JsonObject:
    """vLLM's TokenizerInfoResponse: the tokenizer's configuration (`tokenizer_config.json`
    without file paths, special tokens as their text) with its `tokenizer_class`."""
    info = {k: _plain(v) for k, v in recipe.tokenizer_config.items() if k not in _FILE_FIELDS}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    return info


def _plain(value: Any) -> Any:
    """A configuration value as vLLM serialises it: an added token as its text."""
    if isinstance(value, Mapping):
        if value.get("__type") == "AddedToken" and isinstance(value.get("content"), str):
            return value["content"]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value

"""The route table's generation family: OpenAI's and Anthropic's generation endpoints, their token
counts and vLLM's tokenizer endpoints."""

from __future__ import annotations

from deepinfer_server.api.dialects import Dialect
from deepinfer_server.api.route import Endpoint
from deepinfer_server.api.route_table.entries import generation, post_body
from deepinfer_server.api.routes.count_tokens import count_tokens
from deepinfer_server.api.routes.generation import CHAT, COMPLETIONS, MESSAGES, RESPONSES, generate
from deepinfer_server.api.routes.input_tokens import responses_input_tokens
from deepinfer_server.api.routes.tokenization import (
    detokenize_route,
    tokenize_route,
    tokenizer_info_route,
)
from deepinfer_server.openapi import operations as op
from deepinfer_server.openapi.schema import ref

#: In the order the document lists them.
GENERATION: tuple[Endpoint, ...] = (
    generation(
        "/v1/chat/completions", generate(CHAT), "OpenAI Chat Completions", "ChatCompletionRequest"
    ),
    generation(
        "/v1/completions",
        generate(COMPLETIONS),
        "OpenAI legacy completions, as vLLM serves them",
        "CompletionRequest",
    ),
    generation(
        "/v1/responses",
        generate(RESPONSES),
        "OpenAI Responses (stored unless store: false)",
        "ResponsesRequest",
    ),
    post_body(
        "/v1/responses/input_tokens",
        responses_input_tokens,
        "OpenAI's input token count: the prompt tokens /v1/responses would report as "
        "usage.input_tokens, without running the request",
        "ResponsesRequest",
    ),
    generation(
        "/v1/messages",
        generate(MESSAGES),
        "Anthropic Messages",
        "MessagesRequest",
        Dialect.ANTHROPIC,
    ),
    Endpoint(
        "/v1/messages/count_tokens",
        "POST",
        count_tokens,
        Dialect.ANTHROPIC,
        op.count_tokens(
            "Anthropic token count: the prompt tokens /v1/messages would encode",
            op.ANTHROPIC_ENVELOPE,
        ),
        protected=True,
    ),
    Endpoint(
        "/tokenize",
        "POST",
        tokenize_route,
        Dialect.OPENAI,
        op.post_json(
            "vLLM's tokenize: a prompt, or Chat messages rendered as /v1/chat/completions renders "
            "them (count is that request's prompt_tokens)",
            "TokenizeRequest",
            "TokenizeResponse",
        ),
        protected=True,
    ),
    Endpoint(
        "/detokenize",
        "POST",
        detokenize_route,
        Dialect.OPENAI,
        op.post_json(
            "vLLM's detokenize: token IDs to text", "DetokenizeRequest", "DetokenizeResponse"
        ),
        protected=True,
    ),
    Endpoint(
        "/tokenizer_info",
        "GET",
        tokenizer_info_route,
        Dialect.OPENAI,
        op.get(
            "vLLM's tokenizer_info: the tokenizer's configuration (special tokens, class)",
            op.json_content(ref("TokenizerInfo")),
        ),
        protected=True,
    ),
)

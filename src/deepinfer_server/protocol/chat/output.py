"""ChatOutput: engine tokens in, Chat Completions chunks out (SSE payloads or one JSON body).

Wraps the recipe's StreamProcessor, which parses reasoning, DSML tool calls and stop sequences.
The recipe attaches usage to the finishing chunk whatever the client asked (and omits the key
elsewhere unless include_usage is set); this class reshapes it to what OpenAI sends:
`"usage": null` on every chunk, plus, only with `include_usage`, one extra last chunk with
`"choices": []` and the usage. `continuous_usage_stats` (a vLLM extension GuideLLM uses) puts
the cumulative usage on every chunk instead of null.

A message that is only tool calls has `"content": null`, as OpenAI sends it (the recipe writes
""); streamed, its finishing chunk carries no `content` either, so that clients that add the
deltas up end with null as well.
"""

from __future__ import annotations

from typing import Any

import orjson
from deepseek_recipe import ChatCompletionRequest, ChatCompletionResponse

from deepinfer_server.protocol.chat.request import PreparedChat
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.stream_output import RecipeOutput

_NULL_USAGE_SUFFIX = '"usage":null}'
_NO_USAGE_SUFFIX = "]}"
_ADD_NULL_USAGE = ',"usage":null}'


class ChatOutput(RecipeOutput):
    """Turns one request's engine output into Chat Completions chunks.

    In streaming mode each call returns SSE `data:` payloads (JSON strings); otherwise chunks
    are accumulated and `response_json()` gives the final body.
    """

    def __init__(self, prepared: PreparedChat, completion_id: str, recipe: RecipeContext) -> None:
        generator = ChatCompletionRequest.chunk_generator(
            prepared.request, completion_id, recipe.model_name
        )
        super().__init__(generator, ChatCompletionResponse, completion_id, prepared, recipe)
        self._include_usage = prepared.stream_options.include_usage
        self._continuous_usage = prepared.stream_options.continuous_usage_stats

    def _stream_payloads(self, chunks: list[Any]) -> list[str]:
        payloads: list[str] = []
        for chunk in chunks:
            payload = chunk.to_json()
            if not self._continuous_usage:
                # Fast paths for the common chunks, which need no parsing: the recipe writes
                # `"usage":null` when include_usage is set and no usage key otherwise.
                if payload.endswith(_NO_USAGE_SUFFIX):
                    payloads.append(payload[:-1] + _ADD_NULL_USAGE)
                    continue
                if payload.endswith(_NULL_USAGE_SUFFIX):
                    payloads.append(payload)
                    continue
            payloads.extend(self._reshape_usage(payload))
        return payloads

    def _reshape_usage(self, payload: str) -> list[str]:
        chunk = orjson.loads(payload)
        final_usage = chunk.get("usage")
        if final_usage is None:
            chunk["usage"] = self._running_usage() if self._continuous_usage else None
            return [orjson.dumps(chunk).decode()]
        chunk["usage"] = final_usage if self._continuous_usage else None
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            if choice.get("finish_reason") == "tool_calls" and delta.get("content") == "":
                del delta["content"]
        payloads = [orjson.dumps(chunk).decode()]
        if self._include_usage:
            usage_chunk = {
                "id": chunk["id"],
                "object": chunk["object"],
                "created": chunk["created"],
                "model": chunk["model"],
                "system_fingerprint": chunk.get("system_fingerprint"),
                "choices": [],
                "usage": final_usage,
            }
            payloads.append(orjson.dumps(usage_chunk).decode())
        return payloads

    def response_json(self) -> bytes:
        body = super().response_json()
        if b'"tool_calls":[' not in body:  # no tool call: nothing to change
            return body
        response = orjson.loads(body)
        for choice in response["choices"]:
            message = choice.get("message")
            if message and message.get("tool_calls") and message.get("content") == "":
                message["content"] = None
        return orjson.dumps(response)

    def _running_usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self._prompt_tokens,
            "completion_tokens": self._completion_tokens,
            "total_tokens": self._prompt_tokens + self._completion_tokens,
        }

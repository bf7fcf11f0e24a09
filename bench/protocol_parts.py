#!/usr/bin/env python3
"""The protocol layer's share of the realistic-cadence scenario, in one process, no server.

Times, for the request the "realistic cadence" rows send (a 250-word prompt, thinking off,
200 streamed tokens, one token per push): the request's preparation (`prepare_chat`: checks,
the recipe's conversion and prompt encoding), deepseek-recipe's own `StreamProcessor.push`
plus the chunk's `to_json` (the floor any Chat Completions server on the recipe pays), and our
`ChatOutput.push` around it (the SSE payload it returns). Prints µs per request and per
generated token, and the ratio of `ChatOutput.push` to the recipe's bare call in the same run.

    python bench/protocol_parts.py [--requests 100]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from deepseek_recipe import ChatCompletionRequest, InferenceChunk, PromptUsage, StreamProcessor

from deepinfer_server.ipc.messages import Finish, GeneratedTokens
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from deepinfer_server.protocol.chat.output import ChatOutput
from deepinfer_server.protocol.chat.request import PreparedChat, prepare_chat
from deepinfer_server.protocol.core.recipe import RecipeContext

TOKENS = 200
PROMPT = " ".join(["again"] * (TOKENS + 50))


def _prepare(recipe: RecipeContext) -> PreparedChat:
    body: dict[str, Any] = {
        "model": "flash",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
        "thinking": {"type": "disabled"},
    }
    prepared = prepare_chat(body, recipe)
    assert isinstance(prepared, PreparedChat)
    return prepared


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    requests = parser.parse_args().requests
    recipe = RecipeContext.create(embedded_tokenizer_json(), ("flash",), 65536, True)
    token_ids = recipe.tokenizer.encode(PROMPT)[:TOKENS]
    _prepare(recipe)  # warm-up: the first request builds the recipe's caches

    started = time.perf_counter()
    for _ in range(requests):
        _prepare(recipe)
    prepare_us = (time.perf_counter() - started) / requests * 1e6

    recipe_seconds = output_seconds = 0.0
    for _ in range(requests):
        prepared = _prepare(recipe)
        generator = ChatCompletionRequest.chunk_generator(prepared.request, "x", "flash")
        processor = StreamProcessor(generator, prepared.request.parsing_options, recipe.tokenizer)
        # The opening chunk, as ChatOutput.start() pushes it, outside the timed loop.
        processor.push(InferenceChunk.ready(prompt_usage=PromptUsage(prompt_tokens=1)))
        started = time.perf_counter()
        for token_id in token_ids:
            for chunk in processor.push(InferenceChunk.tokens([token_id], None)):
                chunk.to_json()
        recipe_seconds += time.perf_counter() - started
        processor.close()

        output = ChatOutput(prepared, "chatcmpl-x", recipe)
        output.start()
        batches = [GeneratedTokens([token_id]) for token_id in token_ids]
        started = time.perf_counter()
        for batch in batches:
            output.push(batch)
        output_seconds += time.perf_counter() - started
        output.finish(Finish.LENGTH)
        output.close()

    pushes = requests * len(token_ids)
    recipe_us = recipe_seconds / pushes * 1e6
    output_us = output_seconds / pushes * 1e6
    print(f"prepare_chat: {prepare_us:.0f} µs per request, {prepare_us / TOKENS:.2f} µs per token")
    print(f"recipe StreamProcessor.push + to_json: {recipe_us:.2f} µs per token")
    ratio = output_us / recipe_us
    print(f"ChatOutput.push: {output_us:.2f} µs per token ({ratio:.2f}× the recipe)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Deployment smoke test: /health, /v1/models, one JSON and one streamed chat completion.

Usage: python scripts/smoke.py --base-url http://localhost:8000 [--model NAME] [--api-key KEY]
Prints each check; exits 0 only if every check passes. Needs only the Python standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any


class CheckFailed(Exception):
    pass


def _request(url: str, api_key: str | None, body: dict[str, Any] | None = None) -> bytes:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return bytes(response.read())
    except urllib.error.HTTPError as exc:
        raise CheckFailed(f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}") from exc
    except OSError as exc:
        raise CheckFailed(f"cannot reach {url}: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="server URL, e.g. http://localhost:8000")
    parser.add_argument("--model", help="model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", help="API key, when the server requires one")
    args = parser.parse_args(argv)
    base = args.base_url.rstrip("/")
    state: dict[str, Any] = {"model": args.model}

    def health() -> str:
        reply = json.loads(_request(f"{base}/health", args.api_key))
        if reply.get("status") != "ok":
            raise CheckFailed(f"unexpected health {reply}")
        return "status ok"

    def models() -> str:
        reply = json.loads(_request(f"{base}/v1/models", args.api_key))
        ids = [entry["id"] for entry in reply.get("data", [])]
        if not ids:
            raise CheckFailed("no models listed")
        if state["model"] is None:
            state["model"] = ids[0]
        elif state["model"] not in ids:
            raise CheckFailed(f"{state['model']!r} not in {ids}")
        return f"models {ids}"

    def chat_body(stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": state["model"],
            "messages": [{"role": "user", "content": "Say hello in one short sentence."}],
            "thinking": {"type": "disabled"},
            "max_tokens": 64,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def chat_json() -> str:
        reply = json.loads(_request(f"{base}/v1/chat/completions", args.api_key, chat_body(False)))
        choice = reply["choices"][0]
        content = choice["message"].get("content") or ""
        usage = reply.get("usage") or {}
        if not content or choice["finish_reason"] not in ("stop", "length"):
            raise CheckFailed(f"unexpected completion {reply}")
        if usage.get("completion_tokens", 0) < 1:
            raise CheckFailed(f"no usage in {reply}")
        return f"{usage['completion_tokens']} tokens, finish_reason {choice['finish_reason']}"

    def chat_stream() -> str:
        raw = _request(f"{base}/v1/chat/completions", args.api_key, chat_body(True)).decode()
        events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            raise CheckFailed("stream did not end with [DONE]")
        chunks = [json.loads(event) for event in events[:-1]]
        text = "".join(
            (c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"]
        )
        usage = chunks[-1].get("usage") if chunks and not chunks[-1]["choices"] else None
        if not text or not usage:
            raise CheckFailed(f"no content or no final usage chunk in {len(chunks)} chunks")
        return f"{len(chunks)} chunks, {usage['completion_tokens']} tokens, usage chunk last"

    checks: list[tuple[str, Callable[[], str]]] = [
        ("GET /health", health),
        ("GET /v1/models", models),
        ("POST /v1/chat/completions (JSON)", chat_json),
        ("POST /v1/chat/completions (stream)", chat_stream),
    ]
    failures = 0
    for name, check in checks:
        try:
            print(f"PASS {name}: {check()}")
        except (CheckFailed, KeyError, IndexError, ValueError) as exc:
            failures += 1
            print(f"FAIL {name}: {exc}")
    print(f"{len(checks) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

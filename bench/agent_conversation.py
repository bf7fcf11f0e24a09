"""An agent conversation to replay: a long system prompt, then turns that each add a user
message or a tool result of a few hundred tokens to everything sent before, as Claude Code and
Codex resend the whole conversation on every request.

Deterministic (seeded): the same turns in every run, and different conversations per seed
sharing nothing but their shape.
"""

from __future__ import annotations

import random
from typing import Any

#: The words of the generated text: prose, code and numbers, as agent prompts mix them.
_VOCABULARY = (
    "the agent reads files edits code runs tests and reports what changed in the repository "
    "def main ( ) : return value = compute ( items , limit = 100 ) # a comment about it "
    "error warning 404 500 2026 path / src / module . py line 42 column 7 json { } [ ] "
    "function class import from self config options server request response stream token"
)
_WORDS = _VOCABULARY.split()

#: Tokens per generated word with the DeepSeek V4 tokenizer (measured on this text).
_TOKENS_PER_WORD = 1.15

TOOL = {
    "type": "function",
    "function": {
        "name": "run",
        "description": "Run a shell command in the repository and return its output",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def _text(rng: random.Random, tokens: int) -> str:
    words = max(1, int(tokens / _TOKENS_PER_WORD))
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def conversation_turns(
    seed: int,
    turns: int,
    system_tokens: int = 14_000,
    turn_tokens: tuple[int, int] = (200, 400),
    shared_system: bool = False,
) -> list[list[dict[str, Any]]]:
    """The `messages` of each request of one conversation, in order: every request is the one
    before it plus the previous answer and one user message or tool call and result. With
    `shared_system` every conversation has the same system prompt (as one agent's sessions
    do), else its own."""
    rng = random.Random(seed)
    system = (
        _text(random.Random(0), system_tokens)
        if shared_system
        else f"Session {seed}. " + _text(rng, system_tokens)
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    requests = []
    for turn in range(turns):
        if turn % 2 == 0 or turn == 0:
            messages.append({"role": "user", "content": _text(rng, rng.randint(*turn_tokens))})
        else:
            call_id = f"call_{seed}_{turn}"
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": "run", "arguments": '{"command": "pytest -q"}'},
                        }
                    ],
                }
            )
            output = _text(rng, rng.randint(*turn_tokens))
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        requests.append([dict(message) for message in messages])
        messages.append({"role": "assistant", "content": _text(rng, 30)})
    return requests

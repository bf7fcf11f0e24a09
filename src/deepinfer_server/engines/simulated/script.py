"""What the simulated model says: the last user turn, echoed (README: "The simulated engine").

The prompt's token IDs are decoded, the text between the last `<｜User｜>` and the following
`<｜Assistant｜>` is taken, and that text, encoded with the full vocabulary (so spellings such as
`</think>` or DSML markers become their special tokens), is the answer. In thinking mode (the
prompt ends with `<think>`) an answer without `</think>` is preceded by a fixed reasoning
sentence and `</think>`; a prompt that holds the turn's reasoning up to `</think>` already
gets the answer alone. A prompt with no user turn (a legacy completion) is continued with its
own text, special tokens left out. Images (`multi_modal_data`) are described before the
answer by their size and a short digest, so that clients can test image input on a CPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import cast

from tokenizers import Tokenizer

from deepinfer_server.engines.simulated.inputs import MultiModalData

USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
IMAGE_TOKEN = "<｜image｜>"  # deepseek-recipe's image placeholder
REASONING_SENTENCE = "The user wants their last message repeated back to them."


def last_user_text(prompt_text: str) -> str:
    """The text of the last user turn of a rendered V4.1 prompt ('' if there is none)."""
    start = prompt_text.rfind(USER_TOKEN)
    if start < 0:
        return ""
    start += len(USER_TOKEN)
    end = prompt_text.find(ASSISTANT_TOKEN, start)
    return prompt_text[start:] if end < 0 else prompt_text[start:end]


def describe_images(multi_modal_data: MultiModalData) -> str:
    """`[image 1: 630x476 sha256:0123abcd] ` per image: its size and a digest of its bytes."""
    sizes = cast("list[tuple[int, int]]", multi_modal_data.get("image_sizes") or [])
    data = cast("list[bytes]", multi_modal_data.get("image_bytes") or [])
    parts = []
    for index, (width, height) in enumerate(sizes):
        digest = hashlib.sha256(data[index]).hexdigest()[:8] if index < len(data) else "none"
        parts.append(f"[image {index + 1}: {width}x{height} sha256:{digest}] ")
    return "".join(parts)


class ScriptWriter:
    """Turns a prompt into the token IDs the simulated model will generate."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        think_start = tokenizer.token_to_id(THINK_START)
        self._think_start_id = -1 if think_start is None else int(think_start)

    def answer_tokens(
        self, prompt_token_ids: Sequence[int], multi_modal_data: MultiModalData | None = None
    ) -> list[int]:
        """The answer's token IDs, without EOS; images are described first (`describe_images`)."""
        prompt_text = self._tokenizer.decode(list(prompt_token_ids), skip_special_tokens=False)
        if USER_TOKEN in prompt_text:
            text = last_user_text(prompt_text)
        else:
            text = self._tokenizer.decode(list(prompt_token_ids), skip_special_tokens=True)
        thinking = bool(prompt_token_ids) and prompt_token_ids[-1] == self._think_start_id
        # A turn whose reasoning the prompt already holds, ended (the server forces `</think>`
        # when a reasoning budget is spent): the model goes on with the answer.
        said = prompt_text.rpartition(ASSISTANT_TOKEN)[2] if ASSISTANT_TOKEN in prompt_text else ""
        after_reasoning = said.startswith(THINK_START) and THINK_END in said
        if multi_modal_data:
            text = describe_images(multi_modal_data) + text.replace(IMAGE_TOKEN, "").strip()
        if (thinking or after_reasoning) and THINK_END not in text:
            text = f"{REASONING_SENTENCE}{THINK_END}{text}"
        if after_reasoning:
            text = text.partition(THINK_END)[2]
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

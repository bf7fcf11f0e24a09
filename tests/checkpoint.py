"""A minimal fake checkpoint directory: config.json, the embedded tokenizer files and a
safetensors index naming one (empty) shard."""

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
    shard = "model-00001-of-00001.safetensors"
    (directory / shard).write_bytes(b"")
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"embed.weight": shard}})
    )
    return directory

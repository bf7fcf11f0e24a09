"""A fake DeepSeek-V4.1-Flash checkpoint directory with no weights.

`config.json` has the key set and the constraints DeepInfer 0.1.0's parser and engine check
(`hugging_face/config.py`, `hugging_face/processor.py`, `model_metadata_utils.py`,
`v4_modules/cross_layer.py`); its dimensions are illustrative, not the released model's. The
tokenizer is the embedded one (DeepSeek-V4's with `<｜System｜>` in a reserved slot) in the
release layout DeepInfer requires: 129280 tokens, so that its 21 multimodal span tokens take
IDs 129280-129300. The image placeholder DeepInfer looks for (`<｜deepseek_image｜>`, one of
`multimodal_tokens.CANDIDATE_IMAGE_PLACEHOLDER_TOKENS`) takes another reserved slot, and
`image_token_id` names it: deepseek-recipe's `<｜image｜>` (129279) is not that token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepinfer_server.model.tokenizer import embedded_tokenizer_json

#: DeepInfer's image placeholder in the fake checkpoint, in a reserved V4 slot.
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
IMAGE_PLACEHOLDER_ID = 128798

TEXT_CONFIG: dict[str, Any] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "num_key_value_heads": 1,
    "num_hidden_layers": 8,
    "num_nextn_predict_layers": 1,
    # 0: sliding window; 1, 2: compressed (the only ratios 0.1.0 supports); the first 1 ends
    # the prefill side (the layers after it are YoCo consumers).
    "compress_ratios": [0, 2, 0, 2, 1, 2, 0, 2, 0],
    "candidate_source_layer_id": None,
    "index_source_layer_ids": list(range(8)),
    "kv_source_layer_ids": list(range(8)),
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": None,
    "num_attention_heads": 64,
    "index_topk": 512,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "qk_rope_head_dim": 64,
    "head_dim": 512,
    "hidden_size": 4096,
    "vocab_size": 129280,
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "hc_mult": 4,
    "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "topk_method": "noaux_tc",
    "sliding_window": 128,
    "dspark_block_size": 16,
    "dspark_target_layer_ids": [2, 5],
    "dspark_markov_rank": 64,
    "dspark_noise_token_id": 2,
    "dspark_n_routed_experts": 256,
    "dspark_num_experts_per_tok": 6,
}

VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 1024,
    "patch_size": 14,
    "downsample_ratio": 2,
    "max_image_tokens": 1024,
    "min_pixels": 3136,
    "max_wh_ratio": 200,
}


def checkpoint_config() -> dict[str, Any]:
    """The fake checkpoint's config.json."""
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": IMAGE_PLACEHOLDER_ID,
        "quantization_config": {
            "quant_method": "fp8",
            "expert_dtype": "fp4",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0",
        },
        "text_config": TEXT_CONFIG,
        "vision_config": VISION_CONFIG,
    }


def checkpoint_tokenizer_json() -> str:
    """The embedded tokenizer with DeepInfer's image placeholder in its reserved slot."""
    data = json.loads(embedded_tokenizer_json())
    for token in data["added_tokens"]:
        if token["id"] == IMAGE_PLACEHOLDER_ID:
            assert token["content"].startswith("<｜place▁holder▁no▁"), token
            token["content"] = IMAGE_PLACEHOLDER
    return json.dumps(data, ensure_ascii=False)


def write_checkpoint(directory: Path) -> Path:
    """config.json, the tokenizer files and a safetensors index naming one (empty) shard."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(checkpoint_config(), indent=1))
    (directory / "tokenizer.json").write_text(checkpoint_tokenizer_json(), encoding="utf-8")
    # The release's tokenizer_config.json shape (DeepSeek checkpoints: LlamaTokenizerFast,
    # no unk token; DeepInfer turns BOS insertion on and PAD to <｜▁pad▁｜> itself).
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": False,
                "add_eos_token": False,
                "bos_token": "<｜begin▁of▁sentence｜>",
                "eos_token": "<｜end▁of▁sentence｜>",
                "pad_token": "<｜end▁of▁sentence｜>",
                "unk_token": None,
                "legacy": True,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 1048576,
                "tokenizer_class": "LlamaTokenizerFast",
            },
            ensure_ascii=False,
        ),
        encoding="utf-8",
    )
    shard = "model-00001-of-00001.safetensors"
    (directory / shard).write_bytes(b"")
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"embed.weight": shard}})
    )
    return directory

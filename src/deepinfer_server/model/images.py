"""How the engine takes images: the placeholder token it expands and each image's token count.

deepseek-recipe renders one `<｜image｜>` per image and counts image tokens by its own V4.1
specification. DeepInfer 0.1.0 expands only the placeholder its `MultimodalProcessor` finds in
the checkpoint's tokenizer (`<image>`, else `<｜deepseek_image｜>`:
`multimodal_tokens.CANDIDATE_IMAGE_PLACEHOLDER_TOKENS`), which must be `config.json`'s
`image_token_id`; any other ID passes through as text and the image never reaches the model.
It counts each image's tokens from the checkpoint's `vision_config`
(`ve/processor/image_processor.py` `compute_image_layout`, mirrored here). An `ImagePolicy`
carries the placeholder to send and the geometry to count with, or why images are refused;
`deepinfer_image_policy` derives it from a checkpoint by DeepInfer's own rule.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

#: DeepInfer 0.1.0's image placeholders, in the order it tries them (multimodal_tokens.py).
DEEPINFER_IMAGE_PLACEHOLDERS = ("<image>", "<｜deepseek_image｜>")
#: deepseek-recipe's image placeholder, one per image in the rendered prompt.
RECIPE_IMAGE_PLACEHOLDER = "<｜image｜>"


@dataclass(frozen=True, slots=True)
class ImageGeometry:
    """The checkpoint's `vision_config` entries DeepInfer's image token count depends on."""

    patch_size: int
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int = 0
    max_wh_ratio: float | None = None

    def token_count(self, width: int, height: int) -> int:
        """`compute_image_layout(...).num_tokens`: the tokens one image expands to."""
        # Float arithmetic where DeepInfer's is (a stretched width is not rounded).
        w: float = width
        h: float = height
        if self.max_wh_ratio is not None and w > h * self.max_wh_ratio:
            w = h * self.max_wh_ratio
        pixels = w * h
        if 0 < pixels < self.min_pixels:
            ratio = (self.min_pixels / pixels) ** 0.5
            w = int(w * ratio)
            h = int(h * ratio)
        patch = self.patch_size
        best_width = math.ceil(w / patch) * patch
        best_height = math.ceil(h / patch) * patch
        tokens = self._tokens(best_width, best_height)
        if tokens > self.max_image_tokens:
            tokens = self._fitted_tokens(w, h)
        return tokens

    def _tokens(self, best_width: int, best_height: int) -> int:
        """`_layout_from_pixels`: [START] + ([IMAGE] * w + [NEW_LINE]) * h + [END]."""
        n_llm_h = math.ceil(best_height // self.patch_size / self.downsample_ratio)
        n_llm_w = math.ceil(best_width // self.patch_size / self.downsample_ratio)
        return n_llm_h * (n_llm_w + 1) + 2

    def _fitted_tokens(self, width: float, height: float) -> int:
        """`solve_resize_ratio`: the largest patch grid of the image's aspect within the limit."""
        patch, ratio, limit = self.patch_size, self.downsample_ratio, self.max_image_tokens
        aspect = height / width
        max_w_float = math.sqrt((limit - 2) / aspect + 0.25) - 0.5
        max_h_float = max_w_float * aspect
        if max_w_float < 1.0:
            max_h = (limit - 2) // 2
            best_width, best_height = patch * ratio, max_h * patch * ratio
        elif max_h_float < 1.0:
            max_w = (limit - 2) - 1
            best_width, best_height = max_w * patch * ratio, patch * ratio
        else:
            max_w, max_h = math.floor(max_w_float), math.floor(max_h_float)
            beta = min(max_w * patch * ratio / width, max_h * patch * ratio / height)
            best_width = math.floor(width * beta / patch) * patch
            best_height = math.floor(height * beta / patch) * patch
        return self._tokens(best_width, best_height)


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """What the engine needs of a prompt with images."""

    #: The token ID the engine expands into an image (None: images are refused).
    placeholder_id: int | None
    #: DeepInfer's image token geometry; None counts with deepseek-recipe's specification.
    geometry: ImageGeometry | None = None
    #: Why images are refused, for the 400 (with `placeholder_id` None).
    refusal: str | None = None
    #: deepseek-recipe's placeholder in this tokenizer: what the rendered prompt holds.
    rendered_id: int | None = None

    @classmethod
    def refused(cls, reason: str) -> ImagePolicy:
        return cls(None, None, reason)


def token_ids(tokenizer_json: str) -> dict[str, int]:
    """Every token of a tokenizer.json (vocabulary and added tokens) by its text."""
    data = json.loads(tokenizer_json)
    vocab: dict[str, int] = dict(data.get("model", {}).get("vocab", {}))
    for token in data.get("added_tokens", []):
        vocab[token["content"]] = int(token["id"])
    return vocab


def recipe_image_policy(tokenizer_json: str) -> ImagePolicy:
    """An engine that expands deepseek-recipe's own placeholder (the simulated engine)."""
    placeholder = token_ids(tokenizer_json).get(RECIPE_IMAGE_PLACEHOLDER)
    if placeholder is None:
        return ImagePolicy.refused(
            f"the model's tokenizer has no {RECIPE_IMAGE_PLACEHOLDER} placeholder for images"
        )
    return ImagePolicy(placeholder, rendered_id=placeholder)


def deepinfer_image_policy(checkpoint: str | Path, tokenizer_json: str) -> ImagePolicy:
    """DeepInfer's placeholder and geometry for a checkpoint directory (MultimodalProcessor's
    rule), or why it takes no images: no `vision_config`, no placeholder in the tokenizer, or
    a placeholder that is not `config.json`'s `image_token_id`."""
    try:
        config: dict[str, object] = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return ImagePolicy.refused("the checkpoint's config.json cannot be read")
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return ImagePolicy.refused("the checkpoint has no vision tower (no vision_config)")
    vocabulary = token_ids(tokenizer_json)
    found = [(n, vocabulary[n]) for n in DEEPINFER_IMAGE_PLACEHOLDERS if n in vocabulary]
    if not found:
        names = " or ".join(DEEPINFER_IMAGE_PLACEHOLDERS)
        return ImagePolicy.refused(
            f"the checkpoint's tokenizer has no image placeholder the engine expands ({names})"
        )
    name, placeholder = found[0]
    if config.get("image_token_id") != placeholder:
        return ImagePolicy.refused(
            f"the checkpoint's image_token_id ({config.get('image_token_id')}) is not its "
            f"tokenizer's {name} ({placeholder})"
        )
    try:
        geometry = ImageGeometry(
            patch_size=int(vision["patch_size"]),
            downsample_ratio=int(vision["downsample_ratio"]),
            max_image_tokens=int(vision["max_image_tokens"]),
            min_pixels=int(vision.get("min_pixels", 0)),
            max_wh_ratio=vision.get("max_wh_ratio"),
        )
    except (KeyError, TypeError, ValueError):
        return ImagePolicy.refused("the checkpoint's vision_config lacks its image geometry")
    return ImagePolicy(placeholder, geometry, rendered_id=vocabulary.get(RECIPE_IMAGE_PLACEHOLDER))

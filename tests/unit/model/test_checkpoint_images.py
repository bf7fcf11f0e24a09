"""The image placeholder and token counts the server sends, by DeepInfer's own rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer_server.errors import BadRequestError
from deepinfer_server.ipc.messages import Images
from deepinfer_server.model.images import (
    ImagePolicy,
    deepinfer_image_policy,
    recipe_image_policy,
)
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from deepinfer_server.protocol.core.images import place_images
from tests.checkpoint import IMAGE_PLACEHOLDER_ID, write_checkpoint

RECIPE_PLACEHOLDER_ID = 129279


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "ckpt")


def _policy(checkpoint: Path) -> ImagePolicy:
    return deepinfer_image_policy(checkpoint, (checkpoint / "tokenizer.json").read_text())


def test_deepinfers_placeholder_replaces_the_recipes(checkpoint: Path) -> None:
    policy = _policy(checkpoint)
    assert (policy.placeholder_id, policy.rendered_id) == (IMAGE_PLACEHOLDER_ID, 129279)
    images = Images(sizes=[(300, 200), (28, 28)], data=[b"a", b"b"])
    ids, placed = place_images([5, RECIPE_PLACEHOLDER_ID, 6, RECIPE_PLACEHOLDER_ID], images, policy)
    assert ids == [5, IMAGE_PLACEHOLDER_ID, 6, IMAGE_PLACEHOLDER_ID]
    assert policy.geometry is not None
    expected = sum(policy.geometry.token_count(w, h) - 1 for w, h in images.sizes)
    assert placed.extra_tokens == expected > 0


def test_the_simulated_engine_keeps_the_recipes_placeholder_and_count() -> None:
    policy = recipe_image_policy(embedded_tokenizer_json())
    images = Images(sizes=[(300, 200)], data=[b"a"], extra_tokens=41)
    ids, placed = place_images([5, RECIPE_PLACEHOLDER_ID], images, policy)
    assert ids == [5, RECIPE_PLACEHOLDER_ID] and placed.extra_tokens == 41


def _rewrite_config(checkpoint: Path, **changes: object) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (checkpoint / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"vision_config": None}, "no vision tower"),
        ({"image_token_id": 129279}, "image_token_id (129279) is not its tokenizer's"),
    ],
)
def test_checkpoints_deepinfer_cannot_give_images_to_are_refused(
    checkpoint: Path, change: dict[str, object], reason: str
) -> None:
    _rewrite_config(checkpoint, **change)
    policy = _policy(checkpoint)
    assert policy.placeholder_id is None and reason in (policy.refusal or "")
    with pytest.raises(BadRequestError, match="cannot take images") as raised:
        place_images([RECIPE_PLACEHOLDER_ID], Images(sizes=[(8, 8)], data=[b"x"]), policy)
    assert raised.value.status_code == 400


def test_a_tokenizer_without_deepinfers_placeholder_is_refused(checkpoint: Path) -> None:
    policy = deepinfer_image_policy(checkpoint, embedded_tokenizer_json())
    assert policy.placeholder_id is None
    assert "<image> or <｜deepseek_image｜>" in (policy.refusal or "")


def test_a_placeholder_spelled_in_text_is_a_400(checkpoint: Path) -> None:
    images = Images(sizes=[(8, 8)], data=[b"x"])
    with pytest.raises(BadRequestError, match="2 image placeholders for 1 images"):
        place_images([RECIPE_PLACEHOLDER_ID, RECIPE_PLACEHOLDER_ID], images, _policy(checkpoint))

"""Image input with the official openai client (and Anthropic's shape) against a live server.

The simulated engine describes each image it receives by size and digest before its answer.
"""

from __future__ import annotations

import base64
import re
import struct
import zlib

import httpx
import openai
import pytest

from tests.conftest import MODEL
from tests.server import LiveServer

NO_THINKING = {"thinking": {"type": "disabled"}}
DESCRIPTION = re.compile(r"^\[image 1: (\d+)x(\d+) sha256:[0-9a-f]{8}\] ")


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return struct.pack(">I", len(data)) + kind + data + crc


def _png(width: int, height: int, *, bit_depth: int, color_type: int, idat: bytes) -> bytes:
    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def png(width: int, height: int) -> bytes:
    """A valid RGB PNG."""
    raw = b"".join(b"\x00" + b"\x10\x80\xf0" * width for _ in range(height))
    return _png(width, height, bit_depth=8, color_type=2, idat=zlib.compress(raw))


def bilevel_png(width: int, height: int) -> bytes:
    """A valid one-bit greyscale PNG, compressed row by row: a picture of any size in a
    fraction of a second (30000 x 30000 is 112 MB of rows, where RGB would be 2.7 GB)."""
    row = b"\x00" + b"\x55" * ((width + 7) // 8)
    deflate = zlib.compressobj()
    idat = b"".join(deflate.compress(row) for _ in range(height)) + deflate.flush()
    return _png(width, height, bit_depth=1, color_type=0, idat=idat)


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def image_message(url: str, text: str = "What is this?") -> list[dict[str, object]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


def test_data_url_image_reaches_the_engine(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=image_message(data_url(png(64, 48))),
        extra_body=NO_THINKING,  # type: ignore[arg-type]
    )
    content = response.choices[0].message.content or ""
    assert DESCRIPTION.match(content), content
    assert content.endswith("What is this?")
    other = client.chat.completions.create(
        model=MODEL,
        messages=image_message(data_url(png(48, 64))),
        extra_body=NO_THINKING,  # type: ignore[arg-type]
    )
    assert other.choices[0].message.content != content  # the answer reflects the image
    text_only = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is this?"}],
        extra_body=NO_THINKING,
    )
    # The image counts at its token count (the engine expands its placeholder), not as one.
    assert response.usage is not None and text_only.usage is not None
    assert response.usage.prompt_tokens > text_only.usage.prompt_tokens + 100


def test_responses_input_image_and_anthropic_image_block(
    client: openai.OpenAI, shared_server: LiveServer
) -> None:
    image = png(32, 32)
    response = client.responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "see"},
                    {"type": "input_image", "image_url": data_url(image), "detail": "auto"},
                ],
            }
        ],
        reasoning={"effort": "none"},
    )
    assert DESCRIPTION.match(response.output_text), response.output_text
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
    message = httpx.post(
        shared_server.base_url + "/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 200,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": source},
                        {"type": "text", "text": "look"},
                    ],
                }
            ],
            **NO_THINKING,
        },
        timeout=30,
    )
    assert message.status_code == 200, message.text
    assert DESCRIPTION.match(message.json()["content"][0]["text"])


def test_corrupt_image_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=image_message("data:image/png;base64,iVBORw0KGgoAAAA"),  # type: ignore[arg-type]
        )
    assert caught.value.body["param"] == "messages[0]"  # type: ignore[index]


def test_external_url_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=image_message("https://example.com/cat.png"),  # type: ignore[arg-type]
        )
    assert "data:" in caught.value.message


def test_oversized_image_is_413_and_the_server_stays_healthy(
    client: openai.OpenAI, shared_server: LiveServer
) -> None:
    # 30000 x 30000 pixels in a 173 kB PNG: beyond the decoder's dimension limit.
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=image_message(data_url(bilevel_png(30_000, 30_000))),  # type: ignore[arg-type]
        )
    assert caught.value.status_code == 413
    assert httpx.get(shared_server.base_url + "/health", timeout=10).status_code == 200
    ok = client.chat.completions.create(
        model=MODEL,
        messages=image_message(data_url(png(8, 8))),
        extra_body=NO_THINKING,  # type: ignore[arg-type]
    )
    assert DESCRIPTION.match(ok.choices[0].message.content or "")


def test_too_many_images_is_400(client: openai.OpenAI) -> None:
    url = data_url(png(8, 8))
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(9)]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": parts}],  # type: ignore[list-item]
        )
    assert "at most 8 images" in caught.value.message

"""What preparing a JSON value costs, in bytes, cheaply: whether it is past a bound.

A request's body says little about what its preparation converts and tokenizes when the server
expands it (a stored conversation, a `previous_response_id` chain, stored items): a body of a
few bytes may continue a conversation of megabytes. `preparation_size` walks the expanded
value and stops as soon as it is past the bound, so a small value costs a small walk and a
large one no more than the bound's worth of it (a string counts whole, by its length).
"""

from __future__ import annotations

#: Bytes an image counts for: decoding and resizing one is heavy whatever its JSON size.
IMAGE_COST = 1 << 30
#: Bytes a number, boolean or null counts for (with its separator).
_SCALAR = 8


def preparation_size(value: object, bound: int) -> int:
    """An estimate of `value`'s size as JSON (strings by their UTF-8 length, keys and
    separators included), counted until it is past `bound` (then what was counted so far);
    an image part (`input_image`, `image_url`, `image`) counts `IMAGE_COST`."""
    size = 0
    stack = [value]
    while stack and size <= bound:
        item = stack.pop()
        if isinstance(item, str):
            size += 2 + (len(item) if item.isascii() else len(item.encode()))
        elif isinstance(item, dict):
            if _is_image(item):
                size += IMAGE_COST
                continue
            size += 2
            for key, member in item.items():
                size += 4 + len(key)
                stack.append(member)
        elif isinstance(item, list):
            size += 2 + len(item)
            stack.extend(item)
        else:
            size += _SCALAR
    return size


def _is_image(part: dict[object, object]) -> bool:
    kind = part.get("type")
    return isinstance(kind, str) and kind in {"input_image", "image_url", "image"}

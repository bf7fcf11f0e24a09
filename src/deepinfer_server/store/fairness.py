"""The fair share of a store's backstop cap among its scopes (responses' and conversations')."""

from __future__ import annotations


def fair_level(usage: dict[str, int], cap: int) -> int:
    """The largest size each scope may keep so that the store fits in `cap` (scopes below it
    keep everything; those above are cut down to it): the fair share of the backstop."""
    if sum(usage.values()) <= cap:
        return max(usage.values(), default=0)
    remaining, sizes = cap, sorted(usage.values())
    for index, size in enumerate(sizes):
        share = remaining // (len(sizes) - index)
        if size > share:
            return share
        remaining -= size
    return sizes[-1]

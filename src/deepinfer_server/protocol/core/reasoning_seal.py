"""ReasoningSeal: reasoning text as an opaque, integrity-protected blob (Responses
`encrypted_content`), so that a stateless client can hand it back on its next turn.

A blob is URL-safe base64 of `version byte + UTF-8 text + HMAC-SHA256 tag`, keyed by the
server's secret (`--reasoning-secret` / `$DEEPINFER_REASONING_SECRET`) or, without one, by a
random key made once at start-up. The tag covers the text and a digest of the conversation the
reasoning was written in (`context`, from `responses_reasoning.ConversationDigest`), which the
blob does not carry: it opens only where it is replayed after that same conversation. So a
client can neither forge reasoning nor move a genuine blob into another conversation. Blobs
are opaque, not confidential: the same text is in the reasoning item's `content`. A blob that
does not verify (made before a restart without a configured secret, by another server, for
another conversation, or altered) is ignored.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

#: Version 2: the tag also covers the conversation (version 1 blobs covered the text only).
_VERSION = b"\x02"
_TAG_BYTES = 32
_CONTEXT_BYTES = 32
_KEY_CONTEXT = b"deepinfer-server reasoning seal v1\x00"


def seal_key(secret: str | None) -> bytes:
    """The seal's key for `secret`, or a random one when there is none (make it once per
    server and give it to every API server process: a blob must open in any of them)."""
    material = secret.encode() if secret else secrets.token_bytes(32)
    return hashlib.sha256(_KEY_CONTEXT + material).digest()


class ReasoningSeal:
    """Seals reasoning text into a blob and opens blobs this key sealed."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def from_secret(cls, secret: str | None) -> ReasoningSeal:
        """A seal keyed by `secret`, or by a random key when there is none."""
        return cls(seal_key(secret))

    def seal(self, text: str, context: bytes) -> str:
        """The blob holding `text`, written after the conversation whose digest is `context`."""
        payload = _VERSION + text.encode()
        return base64.urlsafe_b64encode(payload + self._tag(payload, context)).decode().rstrip("=")

    def open(self, blob: object, context: bytes) -> str | None:
        """The text sealed in `blob`, or None unless this key sealed it after the conversation
        whose digest is `context`."""
        if not isinstance(blob, str):
            return None
        try:
            raw = base64.urlsafe_b64decode(blob + "=" * (-len(blob) % 4))
        except (binascii.Error, ValueError):
            return None
        payload, tag = raw[:-_TAG_BYTES], raw[-_TAG_BYTES:]
        if not payload.startswith(_VERSION) or len(tag) != _TAG_BYTES:
            return None
        if not hmac.compare_digest(tag, self._tag(payload, context)):
            return None
        try:
            return payload[len(_VERSION) :].decode()
        except UnicodeDecodeError:
            return None

    def _tag(self, payload: bytes, context: bytes) -> bytes:
        # The context digest has a fixed length, so (context, payload) splits one way only.
        assert len(context) == _CONTEXT_BYTES, "context must be a SHA-256 digest"
        return hmac.digest(self._key, context + payload, "sha256")

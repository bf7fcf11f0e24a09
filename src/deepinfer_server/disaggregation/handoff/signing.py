"""Signed handoffs: the MAC a prefill server puts on its `kv_transfer_params`, checked by the
decode server before it reads or reserves anything, and the proof a release carries.

Both servers of a pair share a secret (`--disaggregation-secret-file`). The prefill server
signs each handoff with HMAC-SHA256 over every field of it (where the KV is, its blocks and
addresses, the transfer ID, the first token), an expiry (`expires_at`, Unix seconds: the signing
time plus the prefill side's hold timeout, after which the KV is freed anyway) and the SHA-256
of the prompt's token IDs, which binds the handoff to its prompt: the decode server hashes its
own encoding of the request, so a handoff moved onto another prompt does not verify. A release
sent to a prefill rank's bootstrap port names its transfer with a proof (HMAC over the transfer
ID under a release key derived from the secret) that only a holder of the secret can make;
without it the release is ignored and counted. The prefill ranks get only that release key:
the secret that signs handoffs stays in the HTTP processes.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import msgspec

from deepinfer_server.disaggregation.handoff.params import KVTransferParams

#: Seconds a decode server's clock may run ahead of its prefill server's.
CLOCK_SKEW_SECONDS = 10
#: The shortest secret accepted, in bytes.
MIN_SECRET_BYTES = 16

_HANDOFF = b"deepinfer-server handoff v1\n"
_RELEASE_KEY = b"deepinfer-server release key v1"
_CANONICAL = msgspec.json.Encoder(order="sorted")


def release_key(secret: bytes) -> bytes:
    """The key release proofs are made with, derived from the pair's secret."""
    return hmac.new(secret, _RELEASE_KEY, hashlib.sha256).digest()


def release_proof(key: bytes, transfer_id: str) -> str:
    """The proof a release of `transfer_id` carries, under release key `key`."""
    return hmac.new(key, transfer_id.encode(), hashlib.sha256).hexdigest()


def release_verified(key: bytes, transfer_id: str, proof: object) -> bool:
    """Whether `proof` is the proof, under release key `key`, for releasing `transfer_id`."""
    return isinstance(proof, str) and hmac.compare_digest(release_proof(key, transfer_id), proof)


class HandoffRefused(ValueError):
    """A handoff that does not verify: its message names why (missing, altered, expired)."""


class HandoffSigner:
    """Signs and verifies one pair's handoffs and release proofs with their shared secret."""

    def __init__(self, secret: bytes, lifetime: float) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a disaggregation secret has at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret
        self._release_key = release_key(secret)
        self._lifetime = lifetime

    def sign(
        self, params: KVTransferParams, prompt_token_ids: Sequence[int], now: float
    ) -> KVTransferParams:
        """`params` with an expiry `lifetime` seconds after `now` (Unix time) and its MAC."""
        signed = msgspec.structs.replace(
            params, expires_at=int(now + self._lifetime) + 1, signature=None, release_proof=None
        )
        signed.signature = self._mac(signed, prompt_token_ids)
        return signed

    def verify(self, params: KVTransferParams, prompt_token_ids: Sequence[int], now: float) -> None:
        """Raise HandoffRefused unless `params` is this pair's unexpired handoff of this prompt."""
        if params.signature is None or params.expires_at is None:
            raise HandoffRefused(
                "kv_transfer_params carries no signature: a decode server accepts only the "
                "signed handoff of a prefill server sharing its --disaggregation-secret-file"
            )
        expected = self._mac(params, prompt_token_ids)
        if not hmac.compare_digest(expected, params.signature):
            raise HandoffRefused(
                "kv_transfer_params does not verify: it was altered, belongs to another "
                "prompt, or was signed with another secret (the prefill and decode servers "
                "must share --disaggregation-secret-file)"
            )
        if now > params.expires_at + CLOCK_SKEW_SECONDS:
            raise HandoffRefused(
                "kv_transfer_params expired: the prefill server no longer holds that KV "
                "(send the request through the gateway again)"
            )

    def armed(self, params: KVTransferParams) -> KVTransferParams:
        """A verified handoff with the proof its release will carry."""
        return msgspec.structs.replace(params, release_proof=self.release_proof(params.transfer_id))

    def release_proof(self, transfer_id: str) -> str:
        """The proof a release of `transfer_id` carries."""
        return release_proof(self._release_key, transfer_id)

    def release_verified(self, transfer_id: str, proof: object) -> bool:
        """Whether `proof` is this pair's proof for releasing `transfer_id`."""
        return release_verified(self._release_key, transfer_id, proof)

    def _mac(self, params: KVTransferParams, prompt_token_ids: Sequence[int]) -> str:
        fields = msgspec.structs.replace(params, signature=None, release_proof=None)
        prompt = hashlib.sha256(msgspec.json.encode(list(prompt_token_ids))).digest()
        message = _HANDOFF + prompt + _CANONICAL.encode(fields)
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

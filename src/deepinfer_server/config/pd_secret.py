"""The secret a prefill/decode pair signs its handoffs with (`disaggregation.handoff.signing`).

It comes from `--disaggregation-secret-file` (the file's bytes, surrounding whitespace
stripped) or `$DEEPINFER_DISAGGREGATION_SECRET`. A server with a prefill or decode role does
not start without one: an unsigned handoff would let anyone who reaches a decode server make it
read a prefill server's memory, and a secret made up at start could not be shared with the
peer. It is not derived from the API keys, which clients hold: a client could then sign
handoffs of its own.
"""

from __future__ import annotations

import os

from deepinfer_server.config.options import ServerConfig
from deepinfer_server.disaggregation.handoff.signing import MIN_SECRET_BYTES
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.errors import ConfigError

#: The environment variable that may carry the secret instead of a file.
SECRET_VARIABLE = "DEEPINFER_DISAGGREGATION_SECRET"


def disaggregation_secret(config: ServerConfig) -> bytes | None:
    """The pair's secret (None on a server without a role and without one); ConfigError when
    a role has none, or it is unreadable or too short."""
    if config.disaggregation_secret_file is not None:
        try:
            with open(config.disaggregation_secret_file, "rb") as file:
                secret = file.read().strip()
        except OSError as exc:
            raise ConfigError(f"--disaggregation-secret-file: {exc}") from None
    else:
        secret = os.environ.get(SECRET_VARIABLE, "").strip().encode()
    if not secret:
        if config.disaggregation_mode is DisaggregationRole.NULL:
            return None
        raise ConfigError(
            f"--disaggregation-mode {config.disaggregation_mode} needs the secret the "
            "prefill/decode pair signs its KV handoffs with: --disaggregation-secret-file "
            f"(or ${SECRET_VARIABLE}), the same on every prefill and decode server"
        )
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the disaggregation secret must have at least {MIN_SECRET_BYTES} bytes "
            "(for example the output of `openssl rand -hex 32`)"
        )
    return secret

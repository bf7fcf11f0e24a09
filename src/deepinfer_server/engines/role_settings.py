"""RoleSettings: what a PROMPT or COMPLETION engine (DeepInfer's, or the simulated one) reads of
the server's options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from deepinfer_server.disaggregation.layout import checkpoint_identity
from deepinfer_server.engines.backend import EngineSpec


@dataclass(frozen=True)
class RoleSettings:
    """One rank's `--disaggregation-*` settings."""

    #: The address the rank's transfer engine and bootstrap port are reached at.
    host: str
    ib_device: str | None
    #: The prefill side's bootstrap port of DP rank 0 (rank r listens on port + r; with 0, every
    #: rank binds a port of its own choosing).
    bootstrap_port: int
    rank: int
    hold_timeout: float
    transfer_timeout: float
    #: What the rank's KV layout names besides its rows: `--speculative-tokens` and the
    #: checkpoint's identity (`disaggregation.layout.checkpoint_identity`).
    speculative_tokens: int = 0
    checkpoint: str | None = None
    #: The pair's release key: a prefill rank honours only releases proven with it.
    release_key: bytes | None = field(default=None, repr=False)
    #: `--disaggregation-transport`: auto, tcp, rdma or nvlink.
    transport: Literal["auto", "tcp", "rdma", "nvlink"] = "auto"

    @classmethod
    def of(cls, spec: EngineSpec) -> RoleSettings:
        """The settings `spec` gives its rank."""
        return cls(
            host=spec.disaggregation_host,
            ib_device=spec.disaggregation_ib_device,
            transport=spec.disaggregation_transport,
            bootstrap_port=spec.disaggregation_bootstrap_port,
            rank=spec.rank,
            hold_timeout=spec.disaggregation_kv_hold_timeout,
            transfer_timeout=spec.disaggregation_transfer_timeout,
            speculative_tokens=spec.speculative_tokens,
            checkpoint=checkpoint_identity(spec.model),
            release_key=spec.disaggregation_release_key,
        )

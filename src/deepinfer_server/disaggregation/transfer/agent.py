"""TransferAgent: one rank's endpoint of the KV-transfer library (Mooncake's Transfer Engine).

Each rank initialises one engine in peer-to-peer handshake mode (no metadata server: a peer is
named by `host:port`, the engine's own RPC port) and registers the memory its KV lives in. A
decode rank reads a prefill rank's registered memory into its own (`read`); the prefill side
takes no part in a read. The engine runs one transport, chosen at start
(`--disaggregation-transport`, `transports`): TCP on every build; RDMA on the devices
`--disaggregation-ib-device` names; NVLink between GPUs of one node on the CUDA builds. The
choice is logged and stamped on the rank's KV layout (`describe`), which its peers compare.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from types import ModuleType

import msgspec

from deepinfer_server.disaggregation.layout import KVLayout, node_identity
from deepinfer_server.disaggregation.transfer.transports import (
    Capabilities,
    Transport,
    TransportRequest,
    choose_transport,
    probe_capabilities,
    transport_environment,
)

logger = logging.getLogger(__name__)

#: Seconds Mooncake's synchronous calls wait before giving up (its `MC_TRANSFER_TIMEOUT`), unless
#: the operator sets it. Effectively never: a read that gives up on its own returns while its
#: socket still reads into the local blocks (the TCP transport's session is not cancelled), so
#: a read must return only when the peer answered or its connection failed. The engine's own
#: transfer timeout ends the request, and its blocks stay reserved until the read returns.
LIBRARY_TRANSFER_TIMEOUT = str(10**9)


class TransferError(Exception):
    """A transfer failed; `reason` is the short metrics label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _engine_module() -> ModuleType:
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", LIBRARY_TRANSFER_TIMEOUT)
    try:
        import mooncake.engine
    except ImportError as exc:
        raise RuntimeError(
            "prefill/decode disaggregation needs Mooncake's Transfer Engine: install the "
            "`disaggregation` extra (pip install '.[disaggregation]' in the deepinfer-server "
            f"checkout) and Debian's libibverbs1 (scripts/install-mooncake-deps.sh) ({exc})"
        ) from exc
    module: ModuleType = mooncake.engine
    return module


class TransferAgent:
    """A rank's transfer engine: its session name, registered memory and reads."""

    def __init__(
        self,
        host: str,
        ib_device: str | None = None,
        transport: TransportRequest = "auto",
        device_memory: bool = False,
        probe: Callable[[ModuleType], Capabilities] = probe_capabilities,
    ) -> None:
        """Start the engine on `host` over the transport `transport` resolves to (raises
        `transports.TransportUnavailable` when it cannot run here); `device_memory`: the KV
        this rank registers is in GPU memory; `probe` reads the build's capabilities."""
        module = _engine_module()
        plan = choose_transport(transport, ib_device, probe(module), device_memory)
        self._engine = module.TransferEngine()
        with transport_environment(plan):
            started = self._engine.initialize(host, "P2PHANDSHAKE", plan.protocol, ib_device or "")
        if started != 0:
            hint = " (are the --disaggregation-ib-device devices here?)" if ib_device else ""
            raise RuntimeError(
                f"the Mooncake transfer engine did not start on {host} over {plan.transport}{hint}"
            )
        self.host = host
        self.port = int(self._engine.get_rpc_port())
        #: The transport every read of this rank's runs over.
        self.transport: Transport = plan.transport
        logger.info(
            "[startup] KV transfer engine %s over %s (%s)",
            self.session,
            plan.transport,
            plan.reason,
        )

    @property
    def session(self) -> str:
        """How peers name this engine."""
        return f"{self.host}:{self.port}"

    def describe(self, layout: KVLayout) -> KVLayout:
        """`layout` with this rank's transport and node: what a peer pairs on besides rows."""
        return msgspec.structs.replace(layout, transport=self.transport, node=node_identity())

    def register(self, address: int, length: int) -> None:
        """Make `length` bytes at `address` readable by peers (and writable by reads)."""
        if self._engine.register_memory(address, length) != 0:
            raise RuntimeError(
                f"the transfer engine could not register {length} bytes for {self.transport}"
            )

    def unregister(self, address: int) -> None:
        self._engine.unregister_memory(address)

    def read(self, session: str, pieces: Sequence[tuple[int, int, int]]) -> int:
        """Copy `(local address, remote address, length)` pieces from peer `session` into this
        rank's registered memory, in one batch (blocking); returns the bytes moved."""
        if not pieces:
            return 0
        local, remote, lengths = (list(column) for column in zip(*pieces, strict=True))
        status = self._engine.batch_transfer_sync_read(session, local, remote, lengths)
        if status != 0:
            raise TransferError(
                "transfer_error", f"reading from {session} failed (transfer engine status {status})"
            )
        return sum(lengths)

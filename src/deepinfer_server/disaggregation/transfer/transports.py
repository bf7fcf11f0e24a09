"""The choice of a rank's KV transport (`--disaggregation-transport`): tcp, rdma or nvlink.

Mooncake's Python `TransferEngine.initialize(host, metadata, protocol, devices)` takes a
protocol name, but the name only picks the allocator of the engine's own buffers (which this
server does not use): the engine installs its transport itself while it initialises, from its
build flags, the RDMA devices it discovers and its environment. So the choice is made through
that environment, set around `initialize` only:

- tcp: `MC_FORCE_TCP` (without it, an engine that discovers an RDMA device installs RDMA).
- rdma: `MC_FORCE_HCA`, with `--disaggregation-ib-device` as the device filter (without it, an
  engine that finds none of the devices falls back to TCP silently; with it, it fails to start).
- nvlink: `MC_INTRANODE_NVLINK` on a build with the intra-node NVLink transport
  (`SUPPORT_INTRA_NVLINK`, built with USE_INTRA_NVLINK: CUDA IPC handles of device memory,
  peers on the same node); else `MC_FORCE_MNNVL` with `MC_USE_NVLINK_IPC` on a build with the
  multi-node NVLink transport (`SUPPORT_MNNVL`, USE_MNNVL), whose IPC mode is likewise
  same-node. Both read and write device memory only (host memory is refused at registration).

An engine installs one transport, and a peer's memory is read through the transport it was
registered with: a rank uses one transport for every peer, and both sides of a pair must use
the same one (the pairing compares them, `disaggregation.layout`). `auto` picks at start, before
any peer is known: rdma when RDMA devices are given, else nvlink when the build offers it and
the KV is in GPU memory, else tcp.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Literal

#: What `--disaggregation-transport` accepts.
TransportRequest = Literal["auto", "tcp", "rdma", "nvlink"]
#: What a rank's transfer engine runs.
Transport = Literal["tcp", "rdma", "nvlink"]

#: Every variable the choice sets or clears around `initialize` (an operator's own setting of
#: one of them would otherwise override the choice).
_CHOICE_VARIABLES = (
    "MC_FORCE_TCP",
    "MC_FORCE_HCA",
    "MC_INTRANODE_NVLINK",
    "MC_FORCE_MNNVL",
    "MC_USE_NVLINK_IPC",
)


class TransportUnavailable(RuntimeError):
    """The transport asked for cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class Capabilities:
    """The NVLink transports the installed Mooncake build carries (its `SUPPORT_*` flags)."""

    intra_nvlink: bool = False
    mnnvl: bool = False

    @property
    def nvlink(self) -> bool:
        """Whether the build has an NVLink transport at all."""
        return self.intra_nvlink or self.mnnvl


def probe_capabilities(module: ModuleType) -> Capabilities:
    """The capabilities `mooncake.engine` reports (an older build without the flags has none)."""
    return Capabilities(
        intra_nvlink=bool(getattr(module, "SUPPORT_INTRA_NVLINK", False)),
        mnnvl=bool(getattr(module, "SUPPORT_MNNVL", False)),
    )


@dataclass(frozen=True)
class TransportPlan:
    """How to start the engine on its transport, and why that transport."""

    transport: Transport
    #: The protocol name `initialize` gets.
    protocol: str
    #: The variables set during `initialize` (the other choice variables are cleared).
    environment: Mapping[str, str] = field(default_factory=dict)
    reason: str = ""


def _nvlink_plan(capabilities: Capabilities, reason: str) -> TransportPlan:
    if capabilities.intra_nvlink:
        return TransportPlan("nvlink", "nvlink_intra", {"MC_INTRANODE_NVLINK": "1"}, reason)
    environment = {"MC_FORCE_MNNVL": "1", "MC_USE_NVLINK_IPC": "1"}
    return TransportPlan("nvlink", "nvlink", environment, reason)


def _refuse_nvlink(capabilities: Capabilities, device_memory: bool) -> None:
    if not capabilities.nvlink:
        raise TransportUnavailable(
            "--disaggregation-transport nvlink: the installed Mooncake Transfer Engine has no "
            "NVLink transport (its build has neither SUPPORT_INTRA_NVLINK nor SUPPORT_MNNVL; "
            "the non-CUDA wheel never has): install the CUDA wheel "
            "(mooncake-transfer-engine or mooncake-transfer-engine-cuda13) or choose tcp or rdma"
        )
    if not device_memory:
        raise TransportUnavailable(
            "--disaggregation-transport nvlink: this engine keeps its KV in host memory, and "
            "Mooncake's NVLink transports move GPU memory only: choose tcp or rdma"
        )


_TCP = TransportPlan("tcp", "tcp", {"MC_FORCE_TCP": "1"})
_RDMA = TransportPlan("rdma", "rdma", {"MC_FORCE_HCA": "1"})


def choose_transport(
    requested: TransportRequest,
    ib_device: str | None,
    capabilities: Capabilities,
    device_memory: bool,
) -> TransportPlan:
    """The transport a rank starts on; raises TransportUnavailable when `requested` cannot run.

    `device_memory`: the rank's KV rows are in GPU memory (NVLink moves nothing else)."""
    if requested == "nvlink":
        _refuse_nvlink(capabilities, device_memory)
        return _nvlink_plan(capabilities, "asked for")
    if requested == "rdma":
        if not ib_device:
            raise TransportUnavailable(
                "--disaggregation-transport rdma needs --disaggregation-ib-device (the RDMA "
                "devices to use, for example mlx5_0)"
            )
        return replace(_RDMA, reason="asked for")
    if requested == "tcp":
        return replace(_TCP, reason="asked for")
    if ib_device:
        return replace(_RDMA, reason="auto: RDMA devices given")
    if capabilities.nvlink and device_memory:
        return _nvlink_plan(capabilities, "auto: no RDMA device given, NVLink built in")
    why = "KV in host memory" if capabilities.nvlink else "no NVLink transport in this build"
    return replace(_TCP, reason=f"auto: no RDMA device given, {why}")


@contextlib.contextmanager
def transport_environment(plan: TransportPlan) -> Iterator[None]:
    """Set the plan's variables (and clear the other choice variables) while the engine
    initialises; restore the process's own afterwards."""
    saved = {name: os.environ.get(name) for name in _CHOICE_VARIABLES}
    for name in _CHOICE_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(plan.environment)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

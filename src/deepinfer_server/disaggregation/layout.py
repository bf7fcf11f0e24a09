"""KVLayout: what shapes the bytes of an engine's KV blocks and state rows, and its comparison.

A KV block or state row moved between two engines is read with the reader's own row sizes: the
bytes mean the same thing only when everything that shapes them is the same on both sides
(the checkpoint, block size, row sizes, dtype, the backtracking depth a state row holds, the
speculative tokens it is sized for, the engine and its version). Each engine describes its
own rows (`KVLayout`); a prefill rank publishes its layout on its bootstrap port, a decode rank
reports its own to its API process, and a pair whose layouts differ is refused before any byte
moves (`layout_mismatch`). The layout also names the rank's KV transport (`transport`: both
sides must run the same one) and its node (`node`, compared only when the transport is NVLink,
which reaches GPUs of the same node only). Any other place that keeps KV rows outside the
engine (a host-memory tier) can describe them with the same type and refuse rows of another
layout the same way.

Defined below handoff, transfer and the engines, which all read it; it imports nothing of theirs.
"""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import msgspec


class KVLayout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """An engine's KV rows as bytes: two engines may exchange rows when their layouts are equal.

    None is "not applicable to this engine" (it is compared like any value).
    """

    #: The engine kind (`--engine`): its rows' meaning.
    engine: str
    #: DeepInfer's installed version (None on the simulated engine).
    deepinfer_version: str | None = None
    #: The checkpoint's identity: a digest of its config.json (None without a checkpoint).
    checkpoint: str | None = None
    #: Positions per KV block.
    block_size: int
    #: Bytes of one KV block row and of one state row.
    block_bytes: int
    state_bytes: int
    #: The element type of the KV rows.
    dtype: str
    #: The tokens a state row can roll back (DEEPINFER_MAX_BACKTRACKING_TOKENS; None when the
    #: engine has no such depth).
    backtracking_tokens: int | None = None
    #: `--speculative-tokens`: MTP draft tokens per sequence per step the rows are sized for.
    speculative_tokens: int = 0
    #: The transport the rank's transfer engine runs (`--disaggregation-transport`: tcp, rdma
    #: or nvlink; None where no engine moves the rows).
    transport: str | None = None
    #: The node the rank runs on (`node_identity`), compared only over NVLink.
    node: str | None = None

    def as_json(self) -> dict[str, object]:
        """The object the bootstrap port publishes."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


#: The fields compared, in the order a mismatch names them (what a user set first).
COMPARED_FIELDS = tuple(name for name in KVLayout.__struct_fields__ if name != "node")
#: The transport that reaches only a peer on the same node.
SAME_NODE_TRANSPORT = "nvlink"


def parse_layout(value: object) -> KVLayout | None:
    """A published layout, or None when `value` is not one."""
    try:
        return msgspec.convert(value, KVLayout)
    except msgspec.ValidationError:
        return None


def layout_mismatch(prefill: KVLayout, decode: KVLayout) -> str | None:
    """What differs between a prefill and a decode side's layouts, each field with both values
    (None: they are the same)."""
    differing = [
        f"{name} (prefill {getattr(prefill, name)!r}, decode {getattr(decode, name)!r})"
        for name in COMPARED_FIELDS
        if getattr(prefill, name) != getattr(decode, name)
    ]
    same_node = prefill.transport == decode.transport == SAME_NODE_TRANSPORT
    if same_node and prefill.node != decode.node:
        differing.append(
            f"node (prefill {prefill.node!r}, decode {decode.node!r}: NVLink reaches only a "
            "prefill server on this node; start both servers with --disaggregation-transport "
            "rdma or tcp to pair across nodes)"
        )
    return "; ".join(differing) or None


def node_identity() -> str:
    """This node's identity: a digest of the kernel's boot ID, which every container on one
    host shares (and hosts do not), else of the host name."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_bytes().strip()
    except OSError:
        boot = b""
    return hashlib.sha256(boot or socket.gethostname().encode()).hexdigest()[:16]


def checkpoint_identity(checkpoint: str | None) -> str | None:
    """A digest of a checkpoint directory's config.json (None without one): the same checkpoint
    on two nodes has the same identity wherever it is mounted."""
    if checkpoint is None:
        return None
    try:
        config = (Path(checkpoint) / "config.json").read_bytes()
    except OSError:
        return None
    return hashlib.sha256(config).hexdigest()[:16]

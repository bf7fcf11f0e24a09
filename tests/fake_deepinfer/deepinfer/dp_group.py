"""The stand-in's DP process group: collectives over TCP that span the ranks, as DeepInfer's do.

DeepInfer's `has_unfinished_requests()` is an all-reduce over the DP group and `close()` a world
barrier (gloo/NCCL, rendezvous at MASTER_ADDR:MASTER_PORT-50). This group gives the simulated
engine inside the stand-in the same semantics across the server's rank processes: rank 0
listens on the rendezvous port, every rank sends each collective's operation and value, and
rank 0 answers with the reduction. Ranks that call different collectives, a peer that never
arrives and a peer that dies all raise, as a hung or broken GPU group would fail.
"""

from __future__ import annotations

import json
import os
import socket
import time

RENDEZVOUS_OFFSET = 50  # DeepInfer listens on MASTER_PORT - 50


class DpGroupError(RuntimeError):
    """The DP ranks left lockstep, or a peer is gone."""


class TcpDpGroup:
    """A DP group of `world_size` ranks; this process is `rank`."""

    def __init__(self, world_size: int, rank: int, timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.rank = rank
        self.timeout = timeout
        self._peers: list[tuple[socket.socket, socket.SocketIO]] = []
        if world_size == 1:
            return
        address = (
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ["MASTER_PORT"]) - RENDEZVOUS_OFFSET,
        )
        if rank == 0:
            self._accept(address)
        else:
            self._connect(address)

    def _accept(self, address: tuple[str, int]) -> None:
        with socket.create_server(address, reuse_port=False) as server:
            server.settimeout(self.timeout)
            for _ in range(self.world_size - 1):
                peer, _ = server.accept()
                peer.settimeout(self.timeout)
                self._peers.append((peer, peer.makefile("rwb")))  # type: ignore[arg-type]

    def _connect(self, address: tuple[str, int]) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                peer = socket.create_connection(address, timeout=self.timeout)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise DpGroupError(f"rank {self.rank}: no DP rendezvous at {address}") from None
                time.sleep(0.05)
        self._peers.append((peer, peer.makefile("rwb")))  # type: ignore[arg-type]

    # Collectives

    def all_reduce_max(self, rank: int, value: int) -> int:
        return self._collective("all_reduce_max", value, max)

    def all_reduce_min(self, rank: int, value: int) -> int:
        return self._collective("all_reduce_min", value, min)

    def barrier(self, rank: int) -> None:
        self._collective("step", 0, max)

    def close_barrier(self, rank: int, timeout: float) -> None:
        self._collective("close", 0, max)
        for peer, stream in self._peers:
            stream.close()
            peer.close()
        self._peers = []

    def abort(self) -> None:
        for peer, _ in self._peers:
            peer.close()

    def _collective(self, op: str, value: int, reduce: object) -> int:
        if self.world_size == 1:
            return value
        if self.rank != 0:
            ((_, stream),) = self._peers
            self._send(stream, {"op": op, "value": value})
            answer = self._receive(stream)
            if "error" in answer:
                raise DpGroupError(answer["error"])
            return int(answer["value"])
        entries = [{"op": op, "value": value}] + [self._receive(s) for _, s in self._peers]
        ops = {entry["op"] for entry in entries}
        if len(ops) > 1:
            error = f"DP ranks entered different collectives: {[e['op'] for e in entries]}"
            for _, stream in self._peers:
                self._send(stream, {"error": error})
            raise DpGroupError(error)
        result = reduce([int(entry["value"]) for entry in entries])  # type: ignore[operator]
        for _, stream in self._peers:
            self._send(stream, {"value": result})
        return int(result)

    def _send(self, stream: socket.SocketIO, message: dict[str, object]) -> None:
        try:
            stream.write(json.dumps(message).encode() + b"\n")  # type: ignore[arg-type]
            stream.flush()  # type: ignore[attr-defined]
        except OSError as exc:
            raise DpGroupError(f"rank {self.rank}: a DP peer is gone ({exc})") from None

    def _receive(self, stream: socket.SocketIO) -> dict[str, object]:
        try:
            line = stream.readline()  # type: ignore[attr-defined]
        except OSError as exc:
            raise DpGroupError(f"rank {self.rank}: a DP peer did not answer ({exc})") from None
        if not line:
            raise DpGroupError(f"rank {self.rank}: a DP peer is gone")
        return dict(json.loads(line))

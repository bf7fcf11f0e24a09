"""Length-prefixed frames on a byte stream: how every message between the server's processes
travels (API <-> rank: msgpack; supervisor <-> API server process: the control channel).

Each frame is a 4-byte little-endian length and that many bytes. The rank links are Unix
stream sockets written and read directly by the two ends, so a message costs one write and one
wake-up of the reader, and no thread in between.
"""

from __future__ import annotations

import asyncio
import struct

_HEADER = struct.Struct("<I")
HEADER_SIZE = _HEADER.size


def frame(payload: bytes) -> bytes:
    """`payload` as one frame."""
    return _HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """The next frame's payload from an asyncio stream (IncompleteReadError at its end)."""
    header = await reader.readexactly(HEADER_SIZE)
    return await reader.readexactly(_HEADER.unpack(header)[0])


class FrameReader:
    """Splits what a stream delivers, in whatever pieces, into whole frames' payloads."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads of the frames `data` completes, in order."""
        buffer = self._buffer
        buffer += data
        frames: list[bytes] = []
        start = 0
        available = len(buffer)
        while available - start >= HEADER_SIZE:
            (length,) = _HEADER.unpack_from(buffer, start)
            end = start + HEADER_SIZE + length
            if end > available:
                break
            frames.append(bytes(buffer[start + HEADER_SIZE : end]))
            start = end
        if start:
            del buffer[:start]
        return frames

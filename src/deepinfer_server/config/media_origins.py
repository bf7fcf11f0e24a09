"""`--allowed-media-domains` entries: `host` (its scheme's default port) or `host:port`."""

from __future__ import annotations


def parse_origin(entry: str) -> tuple[str, int | None]:
    """An entry as (lower-case host, port), the port None for the scheme's default (80 for
    http, 443 for https); an IPv6 address goes in brackets to carry a port (`[::1]:8080`).
    ValueError when the entry is neither `host` nor `host:port`."""
    entry = entry.strip().lower()
    port: str | None = None
    if entry.startswith("["):  # [v6] or [v6]:port
        host, _, rest = entry[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"{entry!r} is not host or host:port")
            port = rest[1:]
    elif entry.count(":") == 1:
        host, port = entry.split(":")
    else:  # a name, an IPv4 address, or a bare IPv6 address
        host = entry
    if not host or any(c in host for c in "/@?#[] "):
        raise ValueError(f"{entry!r} is not host or host:port")
    if port is None:
        return host, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r} has no valid port (1-65535)")
    return host, int(port)

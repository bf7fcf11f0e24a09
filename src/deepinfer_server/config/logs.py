"""The one logging set-up every process of the server uses (the main process, API server
processes and DP ranks differ only in the label that says which process wrote a line)."""

from __future__ import annotations

import logging


def configure_logging(level: str, process: str | None = None) -> None:
    """Log at `level` to stderr; lines of a child process carry `[process]` (`api 1`,
    `rank 0`)."""
    label = f"[{process}] " if process else ""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {label}%(name)s: %(message)s",
    )

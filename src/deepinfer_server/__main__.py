"""`python -m deepinfer_server` runs the command-line entry point."""

from __future__ import annotations

from deepinfer_server.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

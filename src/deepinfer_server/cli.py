"""The `deepinfer-server` command: parse options into a ServerConfig, then run the server."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from deepinfer_server import __version__
from deepinfer_server.config import ServerConfig, resolve
from deepinfer_server.errors import ConfigError

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """An argument parser generated from the fields of ServerConfig."""
    parser = argparse.ArgumentParser(
        prog="deepinfer-server",
        description="OpenAI-compatible server for DeepSeek-V4.1-Flash on DeepInfer "
        "(or on the CPU simulated engine).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    for f in dataclasses.fields(ServerConfig):
        flags = f.metadata["flags"]
        kwargs = dict(f.metadata["argparse"])
        if flags[0].startswith("-"):
            kwargs["dest"] = f.name
        # Repeatable options start from None: argparse cannot append to a tuple default.
        kwargs.setdefault("default", None if kwargs.get("action") == "append" else f.default)
        parser.add_argument(*flags, help=f.metadata["help"], **kwargs)
    return parser


def parse_config(argv: Sequence[str] | None = None) -> ServerConfig:
    """Parse and resolve a command line; raises ConfigError for inconsistent options."""
    namespace = build_parser().parse_args(argv)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(ServerConfig):
        value = getattr(namespace, f.name)
        values[f.name] = tuple(value or ()) if isinstance(f.default, tuple) else value
    return resolve(ServerConfig(**values))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"deepinfer-server: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from deepinfer_server.launcher import run

    return run(config)

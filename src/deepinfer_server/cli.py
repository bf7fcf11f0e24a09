"""The `deepinfer-server` command: parse options into a ResolvedConfig, then run the server.

The parser is generated from the fields of `ServerConfig` and of every registered engine
backend's option group; `--engine` choices come from the registry.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from deepinfer_server import __version__
from deepinfer_server.config import ResolvedConfig, ServerConfig, resolve
from deepinfer_server.config.resolved import withhold_server_secrets
from deepinfer_server.engines.registry import BACKENDS, get_backend
from deepinfer_server.errors import ConfigError

EXIT_USAGE = 2


def _add_fields(parser: argparse._ActionsContainer, options_type: type) -> None:
    for f in dataclasses.fields(options_type):
        flags = f.metadata["flags"]
        kwargs = dict(f.metadata["argparse"])
        if flags[0].startswith("-"):
            kwargs["dest"] = f.name
        if f.name == "engine":
            kwargs["choices"] = sorted(BACKENDS)
        # Repeatable options start from None: argparse cannot append to a tuple default.
        kwargs.setdefault("default", None if kwargs.get("action") == "append" else f.default)
        parser.add_argument(*flags, help=f.metadata["help"], **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """An argument parser generated from ServerConfig and every backend's option group."""
    parser = argparse.ArgumentParser(
        prog="deepinfer-server",
        description="OpenAI- and Anthropic-compatible server for DeepSeek-V4.1-Flash on "
        "DeepInfer (or on the CPU simulated engine).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_fields(parser, ServerConfig)
    for backend in BACKENDS.values():
        group = parser.add_argument_group(f"--engine {backend.name}", backend.summary)
        _add_fields(group, backend.options_type)
    return parser


def _values(namespace: argparse.Namespace, options_type: type) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(options_type):
        value = getattr(namespace, f.name)
        values[f.name] = tuple(value or ()) if isinstance(f.default, tuple) else value
    return values


def parse_config(argv: Sequence[str] | None = None) -> ResolvedConfig:
    """Parse and resolve a command line; raises ConfigError for inconsistent options."""
    namespace = build_parser().parse_args(argv)
    server = ServerConfig(**_values(namespace, ServerConfig))
    backend = get_backend(server.engine)
    options = backend.options_type(**_values(namespace, backend.options_type))
    config = resolve(server, options, backend.defaults)
    backend.validate_options(options, config.data_parallel_size)
    return config


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"deepinfer-server: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    withhold_server_secrets()  # the keys are in `config` now; no child inherits them
    from deepinfer_server.server.launcher import run

    return run(config)

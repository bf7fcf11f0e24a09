"""The Responses store's settings: `--state-dir`, `--response-store` and its time to live.

`--response-store` takes `sqlite` (the default: `responses.sqlite3` in the state directory),
`sqlite:///PATH` (any file), `postgresql://...` (a database shared by replicas) or `none`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from deepinfer_server.errors import ConfigError

SQLITE_FILE = "responses.sqlite3"
_DISABLED = frozenset({"none", "off", "false", "disabled"})
_POSTGRES_SCHEMES = ("postgresql://", "postgres://")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """$DEEPINFER_STATE_DIR, else $XDG_STATE_HOME/deepinfer-server, else
    ~/.local/state/deepinfer-server."""
    env = os.environ if environ is None else environ
    if env.get("DEEPINFER_STATE_DIR"):
        return Path(env["DEEPINFER_STATE_DIR"]).expanduser().absolute()
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base).expanduser().absolute() / "deepinfer-server"


def store_url(value: str, state_dir: Path) -> str | None:
    """The store's URL (an absolute `sqlite:///` path, or the PostgreSQL URL as given), or None
    when the store is disabled; ConfigError for anything else."""
    given = value.strip()
    if given.lower() in _DISABLED:
        return None
    if given.lower() == "sqlite":
        return f"sqlite://{state_dir / SQLITE_FILE}"
    if given.startswith("sqlite://"):
        path = given.removeprefix("sqlite://")
        if not path:
            raise ConfigError("--response-store sqlite:// needs a file: sqlite:///PATH")
        return f"sqlite://{Path(path).expanduser().absolute()}"
    if given.startswith(_POSTGRES_SCHEMES):
        return given
    raise ConfigError(
        f"--response-store {given!r}: expected sqlite, sqlite:///PATH, postgresql://... or none"
    )


def parse_duration(flag: str, value: str) -> float:
    """Seconds from `N`, `Ns`, `Nm`, `Nh` or `Nd` (must be positive)."""
    match = _DURATION.match(value)
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(
            f"{flag} {value!r}: expected a positive duration such as 3600, 12h or 30d"
        )
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]

"""--api-key-file: named keys with optional limits; a malformed file is refused at start with
its line, never with a key."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_server.cli import parse_config
from deepinfer_server.config.tenants import NamedKey, Tenant, read_key_file
from deepinfer_server.errors import ConfigError


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    return str(path)


def test_names_keys_and_limits(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "# tenants\n\nevals sk-e-1 max_running=4 max_queued=0\n  agents sk-a-2 weight=2.5  \n",
    )
    assert read_key_file(path) == (
        NamedKey("sk-e-1", Tenant("evals", max_running=4, max_queued=0)),
        NamedKey("sk-a-2", Tenant("agents", weight=2.5)),
    )


def test_with_api_key_the_keys_of_both_are_accepted(tmp_path: Path) -> None:
    path = _write(tmp_path, "evals sk-e-1\n")
    config = parse_config(["--engine", "simulated", "--api-key", "sk-0", "--api-key-file", path])
    assert config.api_keys == ("sk-0", "sk-e-1")
    assert [t.name for t in config.tenants] == ["api-key-1", "evals"]
    assert "sk-e-1" not in repr(config) and "sk-e-1" not in repr(config.named_keys)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("evals\n", "line 1: expected 'NAME KEY"),
        ("ok sk-1\nbad/name sk-2\n", "line 2: the name 'bad/name' is not"),
        ("evals max_running=3\n", "line 1: evals: the key is missing"),
        ("evals sk-1 max_runing=3\n", "unknown limit 'max_runing=3'"),
        ("evals sk-1 max_running=0\n", "max_running must be an integer >= 1, got '0'"),
        ("evals sk-1 max_queued=-1\n", "max_queued must be an integer >= 0"),
        ("evals sk-1 weight=0\n", "weight must be a positive number"),
        ("evals sk-1 weight=nan\n", "weight must be a positive number"),
        ("evals sk-1 weight=1 weight=2\n", "weight is given twice"),
        ("# nothing\n", "no keys in it"),
        ("a sk-1\na sk-2\n", "the name(s) a are used twice"),
        ("a sk-1\nb sk-1\n", "b has the same key as a"),
    ],
)
def test_a_malformed_file_is_refused_with_its_line_and_without_the_key(
    tmp_path: Path, text: str, reason: str
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        parse_config(["--engine", "simulated", "--api-key-file", path])
    message = str(caught.value)
    assert reason in message
    assert "sk-1" not in message and "sk-2" not in message


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        parse_config(["--engine", "simulated", "--api-key-file", str(tmp_path / "none")])


@pytest.mark.parametrize(
    "flag", ["--key-running-share", "--key-queued-share", "--prefix-cache-retention-share"]
)
@pytest.mark.parametrize("share", ["0", "1.5"])
def test_the_shares_are_fractions(flag: str, share: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        parse_config(["--engine", "simulated", flag, share])

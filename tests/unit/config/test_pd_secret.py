"""The prefill/decode pair's secret: required with a role, from a file or the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_server.cli import parse_config
from deepinfer_server.config.pd_secret import SECRET_VARIABLE
from deepinfer_server.config.resolved import SERVER_ONLY_VARIABLES
from deepinfer_server.disaggregation.handoff.signing import release_key
from deepinfer_server.errors import ConfigError

ARGS = ["--engine", "simulated"]


@pytest.fixture(autouse=True)
def _no_secret_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_VARIABLE, raising=False)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_role_does_not_start_without_the_pairs_secret(mode: str) -> None:
    with pytest.raises(ConfigError, match="--disaggregation-secret-file"):
        parse_config([*ARGS, "--disaggregation-mode", mode])


def test_a_server_without_a_role_needs_no_secret() -> None:
    assert parse_config(ARGS).disaggregation_secret is None
    assert parse_config(ARGS).disaggregation_release_key is None


def test_the_secret_comes_from_the_file_stripped_or_else_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "pd-secret"
    secret.write_text("  a-secret-of-the-pair-0123456789\n")
    monkeypatch.setenv(SECRET_VARIABLE, "the-environments-secret-0123456789")
    argv = [*ARGS, "--disaggregation-mode", "decode"]
    config = parse_config([*argv, "--disaggregation-secret-file", str(secret)])
    assert config.disaggregation_secret == b"a-secret-of-the-pair-0123456789"
    assert config.disaggregation_release_key == release_key(b"a-secret-of-the-pair-0123456789")
    assert parse_config(argv).disaggregation_secret == b"the-environments-secret-0123456789"
    assert SECRET_VARIABLE in SERVER_ONLY_VARIABLES  # no rank or other child inherits it
    assert "a-secret-of-the-pair" not in repr(config)


def test_a_short_or_unreadable_secret_is_refused(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("fifteen-bytes!!\n")
    argv = [*ARGS, "--disaggregation-mode", "prefill", "--disaggregation-secret-file"]
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        parse_config([*argv, str(short)])
    with pytest.raises(ConfigError, match="--disaggregation-secret-file"):
        parse_config([*argv, str(tmp_path / "missing")])

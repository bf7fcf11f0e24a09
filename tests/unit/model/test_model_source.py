"""MODEL resolution: local checkpoints are checked; hub ids resolve through the HF cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_server.engines.registry import BACKENDS
from deepinfer_server.errors import ConfigError
from deepinfer_server.model.source import resolve_model
from tests.checkpoint import write_checkpoint

DEEPINFER = BACKENDS["deepinfer"]
SIMULATED = BACKENDS["simulated"]


def test_local_checkpoint_is_used_as_is(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    assert resolve_model(str(checkpoint), DEEPINFER) == str(checkpoint)


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "tokenizer_config.json"])
def test_incomplete_checkpoint_fails_fast(tmp_path: Path, missing: str) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    (checkpoint / missing).unlink()
    with pytest.raises(ConfigError, match=missing):
        resolve_model(str(checkpoint), DEEPINFER)


def test_simulated_engine_needs_only_the_tokenizer(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    (checkpoint / "config.json").unlink()
    assert resolve_model(str(checkpoint), SIMULATED) == str(checkpoint)


def _fake_hub_cache(home: Path, repo_id: str) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/}."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return write_checkpoint(repo / "snapshots" / revision)


def _offline_hub(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HOME and offline mode, also when huggingface_hub was imported (and read them) before."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_hub_id_resolves_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _offline_hub(tmp_path, monkeypatch)
    snapshot = _fake_hub_cache(tmp_path, "deepseek-ai/DeepSeek-V4.1-Flash-1017")
    resolved = resolve_model("deepseek-ai/DeepSeek-V4.1-Flash-1017", DEEPINFER)
    assert Path(resolved or "").resolve() == snapshot.resolve()


def test_unknown_hub_id_offline_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline_hub(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match="cannot get model 'nobody/nothing'"):
        resolve_model("nobody/nothing", DEEPINFER)


def test_neither_directory_nor_repo_id(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a directory"):
        resolve_model(str(tmp_path / "missing" / "deep" / "path"), DEEPINFER)

"""MODEL as given (a checkpoint directory or a Hugging Face repository id) → a local directory.

DeepInfer reads only local directories, so a repository id is downloaded into the Hugging Face
cache (`HF_HOME`) before any rank starts, with download progress shown. Which files must be
there, and which are downloaded, is the engine backend's declaration.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from deepinfer_server.errors import ConfigError

logger = logging.getLogger(__name__)


class CheckpointFiles(Protocol):
    """What an engine backend (`engines.backend.EngineBackend`) declares of its checkpoint."""

    #: Files the checkpoint directory must hold.
    @property
    def required_files(self) -> tuple[str, ...]: ...

    #: The files a Hugging Face download fetches (None: the whole repository).
    @property
    def download_patterns(self) -> list[str] | None: ...


def check_checkpoint(directory: Path, backend: CheckpointFiles) -> None:
    """Fail fast, with the names, when the directory lacks a file the engine needs."""
    missing = [name for name in backend.required_files if not (directory / name).is_file()]
    if missing:
        raise ConfigError(f"checkpoint directory {directory} lacks {', '.join(missing)}")


def _looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def download(repo_id: str, backend: CheckpointFiles) -> Path:
    """Fetch a repository snapshot into the Hugging Face cache and return its directory."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ConfigError("huggingface_hub is needed to download a model id") from exc
    patterns = backend.download_patterns
    logger.info("[startup] resolving %s in the Hugging Face cache (downloading if needed)", repo_id)
    try:
        path = snapshot_download(repo_id=repo_id, allow_patterns=patterns)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise ConfigError(f"cannot get model {repo_id!r} from the Hugging Face Hub: {exc}") from exc
    return Path(path)


def resolve_model(model: str | None, backend: CheckpointFiles) -> str | None:
    """The local checkpoint directory for MODEL (None when no MODEL was given)."""
    if model is None:
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        check_checkpoint(path, backend)
        return str(path)
    if not _looks_like_repo_id(model):
        raise ConfigError(
            f"MODEL {model!r} is neither a directory nor a Hugging Face repository id"
        )
    local = download(model, backend)
    check_checkpoint(local, backend)
    return str(local)

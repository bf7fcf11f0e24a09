"""Where tests find DeepInfer for `--engine deepinfer`: the CPU twin.

The twin (`site/` here, on top of the directory `scripts/build_deepinfer_twin.py` builds) runs
DeepInfer 0.1.0's own code; `DEEPINFER_TWIN_DIR` names the built directory (`.ci/run` builds
it and sets the variable). Without it, the tests that need DeepInfer (marker `deepinfer_twin`:
every `--engine deepinfer` test) skip, saying so, or fail where every lane must run
(tests/lanes.py).
"""

from __future__ import annotations

import os
from pathlib import Path

SITE = Path(__file__).resolve().parent / "site"
NOT_BUILT = (
    "the DeepInfer CPU twin is not built: run `python scripts/build_deepinfer_twin.py` and set "
    "DEEPINFER_TWIN_DIR to the directory it prints (.ci/run does both)"
)


def twin_dir() -> Path | None:
    """The built twin named by DEEPINFER_TWIN_DIR, if it is there."""
    configured = os.environ.get("DEEPINFER_TWIN_DIR")
    if not configured:
        return None
    path = Path(configured)
    return path if (path / "deepinfer" / "_C.ok").is_file() else None


def engine_pythonpath() -> str:
    """PYTHONPATH entries that make the twin's `deepinfer` importable (none where it is not
    built: the tests that need it skip)."""
    built = twin_dir()
    entries = [str(SITE), str(built)] if built is not None else []
    return os.pathsep.join(filter(None, [*entries, os.environ.get("PYTHONPATH")]))


def engine_env(visible_gpus: str) -> dict[str, str]:
    """The environment of a `--engine deepinfer` server on `visible_gpus`: DeepInfer on the
    path, and the twin's node holding as many GPUs as the server sees (the server and DeepInfer
    must count the same node: the grammar CPU budget is cores per GPU)."""
    return {
        "PYTHONPATH": engine_pythonpath(),
        "CUDA_VISIBLE_DEVICES": visible_gpus,
        "DEEPINFER_TWIN_GPUS": str(len(visible_gpus.split(","))),
    }


def runs_on_twin() -> bool:
    """Whether the twin is built (DEEPINFER_TWIN_DIR names it)."""
    return twin_dir() is not None

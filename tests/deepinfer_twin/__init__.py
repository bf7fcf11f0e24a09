"""Where tests find DeepInfer for `--engine deepinfer`: the CPU twin, else the stand-in.

The twin (`site/` here, on top of the directory `scripts/build_deepinfer_twin.py` builds) runs
DeepInfer 0.1.0's own code; `DEEPINFER_TWIN_DIR` names the built directory (`.ci/run` builds
it and sets the variable). Without it, `--engine deepinfer` tests run on the pure stand-in
(`tests/fake_deepinfer`), and tests that need DeepInfer's own code skip, saying so.
"""

from __future__ import annotations

import os
from pathlib import Path

SITE = Path(__file__).resolve().parent / "site"
STAND_IN = Path(__file__).resolve().parent.parent / "fake_deepinfer"
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
    """PYTHONPATH entries that make `deepinfer` importable: the twin's, else the stand-in's."""
    built = twin_dir()
    entries = [str(SITE), str(built)] if built is not None else [str(STAND_IN)]
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
    return twin_dir() is not None

"""Import hooks: the twin's platform as soon as `deepinfer` is imported, and the twin's worker
in place of `deepinfer.worker.worker`."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence

#: DeepInfer modules the twin provides itself, and the twin module that stands for each.
REPLACED_MODULES = {"deepinfer.worker.worker": "deepinfer_twin.worker"}


class _DeepInferHook(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        after = _AFTER_IMPORT.get(fullname)
        if after is not None:
            spec = self._real_spec(fullname, path)
            assert spec is not None and spec.loader is not None
            spec.loader = _AfterExec(spec.loader, after)
            return spec
        replacement = REPLACED_MODULES.get(fullname)
        if replacement is not None:
            found = importlib.util.find_spec(replacement)
            assert found is not None and found.origin is not None
            return importlib.util.spec_from_file_location(fullname, found.origin)
        return None

    def _real_spec(
        self, fullname: str, path: Sequence[str] | None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path)
            if spec is not None:
                return spec
        return None


class _AfterExec(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, after: object) -> None:
        self._loader = loader
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self._after(module)  # type: ignore[operator]


def _after_deepinfer(module: types.ModuleType) -> None:
    from deepinfer_twin import cuda, node, platform, record

    record.remember_import_environment()
    cuda.install()
    node.install()
    platform.install()


def _after_engine_module(module: types.ModuleType) -> None:
    """The CPU build has no CUDA graph timer (csrc/graph_timer is CUDA only): an empty one."""
    timer = types.ModuleType("deepinfer._C.graph_timer", "CUDA graph timer: absent on a CPU")
    module.graph_timer = timer  # type: ignore[attr-defined]
    sys.modules[timer.__name__] = timer


def _after_llm_engine(module: types.ModuleType) -> None:
    from deepinfer_twin import record

    record.install_engine_tap(module)


def _after_multimodal_processor(module: types.ModuleType) -> None:
    from deepinfer_twin import record

    record.install_fork_tap(module)


_AFTER_IMPORT = {
    "deepinfer": _after_deepinfer,
    "deepinfer._C": _after_engine_module,
    "deepinfer.engine.llm_engine": _after_llm_engine,
    "deepinfer.ve.multimodal_processor": _after_multimodal_processor,
}


def install() -> None:
    if not any(isinstance(finder, _DeepInferHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeepInferHook())

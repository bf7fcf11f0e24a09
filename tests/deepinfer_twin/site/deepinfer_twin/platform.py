"""The twin's platform: DeepInfer's GPU platform with CPU collectives and no kernel backend."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

#: DeepInfer picks its kernel modules by `PLATFORM.tilelang_ops_backend`; the twin's backend is
#: an empty package, so asking `ops` for any kernel raises DeepInfer's KernelUnavailableError.
TWIN_KERNEL_BACKEND = "twin_cpu"
_BACKEND_MODULE = f"deepinfer.model_executor.layers.tilelang_ops.{TWIN_KERNEL_BACKEND}"


def make_platform() -> object:
    """A `PlatformGPU` whose process groups are gloo (DeepInfer's CPU groups already are)."""
    from deepinfer.platform import PlatformGPU

    class TwinPlatform(PlatformGPU):
        tilelang_ops_backend = TWIN_KERNEL_BACKEND
        distributed_backend = "gloo"

        def pin_host_memory(self, tensor: object) -> None:
            del tensor

        def unpin_host_memory(self, ptr: int) -> None:
            del ptr

        def get_distributed_options(self) -> object:
            return None

    return TwinPlatform()


class _EmptyBackendFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _BACKEND_MODULE:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, "No kernels: the DeepInfer twin runs on a CPU.")
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        del module


def install() -> None:
    """Make `deepinfer.PLATFORM` the twin's, before any DeepInfer module reads it."""
    if not any(isinstance(finder, _EmptyBackendFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _EmptyBackendFinder())
    import deepinfer

    if "PLATFORM" not in vars(deepinfer):
        deepinfer.PLATFORM = make_platform()  # type: ignore[attr-defined]

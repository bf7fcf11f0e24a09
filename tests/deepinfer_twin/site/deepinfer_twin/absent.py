"""Importable placeholders for DeepInfer's GPU kernel packages, which do not exist on a CPU.

DeepInfer's modules import tilelang, deep_gemm, deep_ep, FlashMLA and friends at module level
(kernels are declared with decorators at import). The twin never runs a kernel: its worker
replaces the model forward. So each such package is a placeholder module whose every attribute
is a placeholder class: it can be imported from, subclassed, used as a decorator or called at
import time, and a module-level constant built from it is another placeholder. Anything that
then treats a placeholder as real data fails at once (it is not a tensor), which is the point:
a code path that reaches a kernel shows in the twin as an error, never as a silent success.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

#: Top-level packages that hold only GPU kernels or their launchers.
KERNEL_PACKAGES = (
    "tilelang",
    "tile_kernels",
    "deep_gemm",
    "deep_ep",
    "flash_mla",
    "flash_attn",
    "deep_select",
)


class _AbsentMeta(type):
    """The metaclass of placeholders: attribute access yields further placeholders."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _absent_class(f"{cls.__qualname__}.{name}")


class Absent(metaclass=_AbsentMeta):
    """An instance stands for the result of calling a GPU kernel or its factory."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A decorator factory's result is applied to the decorated function: keep the function,
        # so that a kernel's Python body stays inspectable and calling it reaches the kernel.
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return Absent()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _absent_class(f"{type(self).__qualname__}.{name}")

    def __getitem__(self, key: object) -> Any:
        return Absent()

    def __iter__(self) -> Any:
        return iter(())

    def __bool__(self) -> bool:
        return False


def _absent_class(qualname: str) -> type[Absent]:
    return _AbsentMeta(qualname.rsplit(".", 1)[-1], (Absent,), {"__qualname__": qualname})


class _AbsentModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _absent_class(f"{self.__name__}.{name}")


class _AbsentLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _AbsentModule(spec.name)
        module.__path__ = []  # a package, so that submodules import too
        module.__dict__["TWIN_PLACEHOLDER"] = True
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        del module


class AbsentKernelFinder(importlib.abc.MetaPathFinder):
    """Finds a placeholder for a kernel package only where the real one is not installed."""

    def __init__(self, packages: Sequence[str] = KERNEL_PACKAGES) -> None:
        self._packages = frozenset(packages)
        self._loader = _AbsentLoader()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top not in self._packages:
            return None
        if "." not in fullname and self._installed(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self._loader, is_package=True)

    def _installed(self, name: str) -> bool:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            if finder.find_spec(name, None) is not None:
                return True
        return False


def install() -> None:
    """Put the finder first on `sys.meta_path` (once)."""
    if not any(isinstance(finder, AbsentKernelFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, AbsentKernelFinder())

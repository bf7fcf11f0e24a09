#!/usr/bin/env python3
"""Build the DeepInfer CPU twin: DeepInfer 0.1.0's own Python package with its C++ engine module.

DeepInfer's `_C.engine` (the scheduler, block manager, sequences, request-output pool and input
preparation under `csrc/engine/`) has no GPU code, so it is compiled here for the CPU against the
installed CPU torch. Two gaps are filled at build time, outside DeepInfer's sources:

- `csrc/cuda_utils.cpp` needs CUDA; a CPU translation unit defines the same functions.
- `csrc/utils/log.hpp` includes `<format>`, which GCC 12's libstdc++ lacks; an include directory
  placed first maps `std::format` and `std::format_string` onto {fmt}, header-only (the copy
  torch ships in its include directory, so no system package is needed).

The module's init (`MODULE_INIT`, the build's own file) also adds `_C.twin_probe`, read-only
accessors for what DeepInfer keeps in C++ and binds to no Python name: a sequence's block table
and the block managers' reference counts (the prefix-cache property tests check them).

DeepInfer declares Python >= 3.12, and two of its class headers use PEP 695's `class X[T]:`;
on Python 3.11 those two lines are rewritten to `class X(Generic[T]):` (the only 3.12 syntax in
the release: `REWRITES_FOR_PY311`). Nothing else in its sources changes.

The result is a directory holding DeepInfer's `deepinfer` and `deep_cluster` packages with the
built `_C` module inside `deepinfer/`; put it on `sys.path` to import the twin. It is cached under
`--cache-dir` (default `$DEEPINFER_TWIN_CACHE` or `~/.cache/deepinfer-server/twin`) in a folder
named after the sdist's hash, the torch version, the Python ABI and the compiler, so a second
build with the same inputs costs nothing. The path is printed on the last line of stdout.

The sdist comes from `--sdist`, else `$DEEPINFER_SDIST`, else `../shared/reference/` beside the
repository, else the configured package index (PyPI's `deepinfer==0.1.0`).
"""

from __future__ import annotations

import argparse
import compileall
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

DEEPINFER_VERSION = "0.1.0"
SDIST_NAME = f"deepinfer-{DEEPINFER_VERSION}.tar.gz"
REPO_ROOT = Path(__file__).resolve().parent.parent

# DeepInfer's setup.py COMMON_SOURCES, less csrc/pybind.cpp (its module init also registers the
# CUDA graph timer) and csrc/graph_timer/pybind.cpp (CUDA only).
ENGINE_SOURCES = (
    "csrc/engine/pybind.cpp",
    "csrc/engine/pybind_sequence.cpp",
    "csrc/engine/pybind_scheduler.cpp",
    "csrc/engine/pybind_output.cpp",
    "csrc/engine/zos.cpp",
    "csrc/engine/input_metadata/block_load_plan.cpp",
    "csrc/engine/input_metadata/prepare_tensor_input_base.cpp",
    "csrc/engine/input_metadata/prepare_tensor_input_v4.cpp",
    "csrc/engine/prepare_sample.cpp",
)

# <format> for GCC 12: the two names DeepInfer's log.hpp uses, from {fmt}.
FORMAT_SHIM = """\
#pragma once
#include <fmt/format.h>
namespace std {
template <typename... Args> using format_string = ::fmt::format_string<Args...>;
using ::fmt::format;
}
"""

# The CPU side of csrc/cuda_utils.hpp: no device memory, no IPC, copies are memcpy on stream 0.
CPU_UTILS = """\
#include <cstring>
#include <optional>
#include <torch/extension.h>
#include "cuda_utils.hpp"

namespace deepinfer::cuda::utils {

std::optional<torch::Tensor> alloc_tensor(ssize_t size) {
    return torch::empty({size}, at::TensorOptions().dtype(torch::kByte));
}

std::optional<torch::Tensor> import_ipc_tensor(py::bytes) { return std::nullopt; }

py::bytes export_ipc_tensor(size_t, ssize_t) {
    TORCH_CHECK(false, "CUDA IPC is not available in the CPU build of DeepInfer's engine module");
}

void cuda_copy_async(void *dst, void *src, size_t size, uint64_t) { std::memcpy(dst, src, size); }

uint64_t get_current_stream() { return 0; }

void pymodule_init(pybind11::module &m) {
    m.def("alloc_tensor", &alloc_tensor, py::arg("size"));
    m.def("import_ipc_tensor", &import_ipc_tensor, py::arg("data"));
    m.def("export_ipc_tensor", &export_ipc_tensor, py::arg("ptr"), py::arg("nbytes"));
}

} // namespace deepinfer::cuda::utils
"""

MODULE_INIT = """\
#include <torch/extension.h>
#include "cuda_utils.hpp"
#include "engine/block_manager.hpp"
#include "engine/pybind.hpp"
#include "engine/sequence.hpp"

PYBIND11_MODULE(_C, m) {
    pybind11::module cuda_utils = m.def_submodule("cuda_utils", "DeepInfer cuda utils (CPU build)");
    deepinfer::cuda::utils::pymodule_init(cuda_utils);
    pybind11::module engine = m.def_submodule("engine");
    deepinfer::engine::pymodule_init(engine);
    // `from deepinfer._C.engine import ...` needs the submodules in sys.modules: DeepInfer's own
    // build gets them from its package layout, this one from its init.
    pybind11::module::import("sys").attr("modules")["deepinfer._C.engine"] = engine;
    pybind11::module::import("sys").attr("modules")["deepinfer._C.cuda_utils"] = cuda_utils;
    // The twin's probe (tests only): what DeepInfer keeps in C++ and binds to no Python name.
    pybind11::module probe = m.def_submodule("twin_probe", "the CPU twin's read-only probe");
    probe.def("block_table", [](Sequence &seq) { return seq.cache.block_table; }, py::arg("seq"));
    probe.def("ref_counts", [](BlockManager &manager) {
        std::vector<int> counts;
        counts.reserve(manager.blocks._blocks.size());
        for (auto &block : manager.blocks._blocks) counts.push_back(block.ref_count);
        return counts;
    }, py::arg("manager"));
    pybind11::module::import("sys").attr("modules")["deepinfer._C.twin_probe"] = probe;
}
"""

# -O1, not DeepInfer's -O2: the twin's scheduler is not the hot path here, and it compiles in a
# fraction of the time.
#: (file, the line as released, the line for Python 3.11, the import that the new line needs).
REWRITES_FOR_PY311 = (
    (
        "deepinfer/environ.py",
        "class EnvVar[T]:",
        "class EnvVar(Generic[T]):",
        'from typing import Generic, TypeVar\nT = TypeVar("T")\n',
    ),
    (
        "deepinfer/model_executor/utils.py",
        "class Movable[T]:",
        "class Movable(Generic[T]):",
        "from typing import Generic\n",
    ),
)

#: Bumped when the layout of a cached twin changes without a change to the compiled module.
LAYOUT_REVISION = "2"

CXX_FLAGS = (
    "-O1",
    "-DFMT_HEADER_ONLY",
    "-std=c++20",
    "-Wno-deprecated-declarations",
    "-D_GLIBCXX_USE_CXX11_ABI=1",
    "-fvisibility=hidden",
)


def default_cache_dir() -> Path:
    configured = os.environ.get("DEEPINFER_TWIN_CACHE")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "deepinfer-server" / "twin"


def find_sdist(explicit: str | None, workdir: Path) -> Path:
    """The DeepInfer 0.1.0 sdist: given, beside the repository, or from the package index."""
    for candidate in (explicit, os.environ.get("DEEPINFER_SDIST")):
        if candidate:
            return Path(candidate)
    shared = REPO_ROOT.parent / "shared" / "reference" / SDIST_NAME
    if shared.is_file():
        return shared
    return download_sdist(workdir)


#: The index pip uses when none is configured.
PIP_DEFAULT_INDEX = "https://pypi.org/simple"


def package_index_url() -> str:
    """The index pip is configured with (PIP_INDEX_URL, pip's config, else pip's default)."""
    configured = os.environ.get("PIP_INDEX_URL")
    if configured:
        return configured
    completed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
        capture_output=True,
        text=True,
        check=False,
    )
    if completed.returncode == 0 and completed.stdout.strip():
        return completed.stdout.strip()
    # pip's default, written out: importing pip here (its `PyPI.simple_url`) would make
    # setuptools leave distutils to the standard library in this process, and torch's
    # extension builder then fails on setuptools' own assertion.
    return PIP_DEFAULT_INDEX


def download_sdist(workdir: Path) -> Path:
    """The release's sdist from the package index's simple API (PEP 691), checked against the
    index's sha256. `pip download` cannot fetch it: preparing its metadata runs DeepInfer's
    setup.py, which needs CUDA."""
    import httpx

    index = package_index_url().rstrip("/")
    page = httpx.get(
        f"{index}/deepinfer/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
        follow_redirects=True,
        timeout=60,
    )
    page.raise_for_status()
    (entry,) = [f for f in page.json()["files"] if f["filename"] == SDIST_NAME]
    target = workdir / SDIST_NAME
    with httpx.stream("GET", entry["url"], follow_redirects=True, timeout=300) as response:
        response.raise_for_status()
        with target.open("wb") as stream:
            for chunk in response.iter_bytes():
                stream.write(chunk)
    expected = entry.get("hashes", {}).get("sha256")
    actual = hashlib.sha256(target.read_bytes()).hexdigest()
    if expected and actual != expected:
        raise SystemExit(f"{SDIST_NAME}: sha256 {actual} is not the index's {expected}")
    return target


def compiler_identity() -> str:
    cxx = os.environ.get("CXX", "c++")
    completed = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    return completed.stdout.splitlines()[0]


def cache_key(sdist: Path) -> str:
    import torch

    digest = hashlib.sha256()
    digest.update(sdist.read_bytes())
    for part in (
        torch.__version__,
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        compiler_identity(),
        FORMAT_SHIM,
        CPU_UTILS,
        MODULE_INIT,
        " ".join(CXX_FLAGS),
    ):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def unpack(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as archive:
        archive.extractall(into, filter="data")
    (source,) = [p for p in into.iterdir() if p.is_dir()]
    return source


def rewrite_for_py311(tree: Path) -> None:
    """Rewrite the release's two PEP 695 class headers for Python 3.11 (exact lines, or fail)."""
    for relative, released, rewritten, needed_import in REWRITES_FOR_PY311:
        path = tree / relative
        text = path.read_text(encoding="utf-8")
        if text.count(f"\n{released}\n") != 1:
            raise SystemExit(f"{relative}: expected the line {released!r} once; is this 0.1.0?")
        text = text.replace(f"\n{released}\n", f"\n{needed_import}\n\n{rewritten}\n")
        path.write_text(text, encoding="utf-8")


def compile_engine_module(source: Path, build_dir: Path) -> Path:
    """Compile `_C` (engine and CPU cuda_utils) with ninja through torch's extension builder."""
    from torch.utils import cpp_extension

    shim_dir = build_dir / "shim"
    shim_dir.mkdir(parents=True, exist_ok=True)
    (shim_dir / "format").write_text(FORMAT_SHIM)
    (build_dir / "cpu_utils.cpp").write_text(CPU_UTILS)
    (build_dir / "module.cpp").write_text(MODULE_INIT)
    sources = [str(source / s) for s in ENGINE_SOURCES]
    sources += [str(build_dir / "cpu_utils.cpp"), str(build_dir / "module.cpp")]
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    cpp_extension.load(
        name="_C",
        sources=sources,
        extra_cflags=[f"-I{shim_dir}", *CXX_FLAGS],
        extra_include_paths=[str(source / "csrc")],
        extra_ldflags=["-lpthread"],
        build_directory=str(build_dir),
        with_cuda=False,
        is_python_module=True,
        verbose=True,
    )
    return build_dir / "_C.so"


def compile_bytecode(directory: Path) -> None:
    """Write the twin's bytecode next to its sources (kept in the cache; what is current is
    skipped): every rank and CP worker imports DeepInfer, and with PYTHONDONTWRITEBYTECODE set
    each would otherwise compile its modules again."""
    if not compileall.compile_dir(directory, quiet=1):
        raise SystemExit(f"could not compile the twin's Python files in {directory}")


def build(cache_dir: Path, sdist_arg: str | None) -> Path:
    """The twin's directory, built or taken from the cache."""
    with tempfile.TemporaryDirectory(prefix="deepinfer-twin-") as tmp:
        work = Path(tmp)
        sdist = find_sdist(sdist_arg, work)
        target = cache_dir / cache_key(sdist)
        marker = target / "deepinfer" / "_C.ok"
        if marker.is_file() and marker.read_text().startswith(f"layout {LAYOUT_REVISION}\n"):
            compile_bytecode(target)
            return target
        started = time.monotonic()
        source = unpack(sdist, work / "src")
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        built = target / "deepinfer" / f"_C{suffix}"
        staging = cache_dir / f".staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for package in ("deepinfer", "deep_cluster"):
            shutil.copytree(source / package, staging / package)
        if sys.version_info < (3, 12):
            rewrite_for_py311(staging)
        if built.is_file():
            module = built  # a layout change only: the compiled module is still valid
        else:
            # The object files outlive a failed attempt, so a retry compiles only what changed.
            module = compile_engine_module(source, cache_dir / f".build-{target.name}")
        shutil.copy2(module, staging / "deepinfer" / f"_C{suffix}")
        compile_bytecode(staging)
        elapsed = time.monotonic() - started
        (staging / "deepinfer" / "_C.ok").write_text(
            f"layout {LAYOUT_REVISION}\nbuilt in {elapsed:.0f} s from {sdist.name}\n"
        )
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        shutil.rmtree(cache_dir / f".build-{target.name}", ignore_errors=True)
        print(f"twin built in {time.monotonic() - started:.0f} s", file=sys.stderr)
        return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument("--sdist", help="path of deepinfer-0.1.0.tar.gz")
    args = parser.parse_args()
    target = build(args.cache_dir, args.sdist)
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())

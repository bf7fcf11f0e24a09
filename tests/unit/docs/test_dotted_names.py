"""Every dotted name the docs give for the server's own code resolves.

A name in backticks whose first part is `deepinfer_server` or the short name of one of the
package's modules (`launcher.serve`, `server.launcher.run`, `sampling.SAMPLING_FIELDS`) must be
importable, attribute by attribute, from one module of that name: a rename that leaves the docs
behind fails here. Field paths (`usage.prompt_tokens`), file names (`engine.py`) and DeepInfer's
names (`seq.state_id`) start with no module name of the package and are not checked.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections import defaultdict
from types import ModuleType

import deepinfer_server
from tests.paths import REPO

_DOTTED = re.compile(r"`([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\(\))?`")
#: Module names of the package that the docs also use for other things: the SDKs' resources
#: (`responses.retrieve`), response fields (`logprobs.content`) and DeepInfer's objects
#: (`scheduler.get_num_preempted_seqs`), request fields (`structured_outputs.regex`).
_NOT_CODE = frozenset(
    {"models", "logprobs", "responses", "reasoning", "chat"}
    | {"scheduler", "engine", "messages", "completions", "structured_outputs"}
)
_SUFFIXES = frozenset({"py", "md", "json", "yml", "yaml", "toml", "txt", "cfg", "sh"})


def _modules_by_short_name() -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    found["deepinfer_server"].append("deepinfer_server")
    for info in pkgutil.walk_packages(deepinfer_server.__path__, "deepinfer_server."):
        parts = info.name.split(".")
        for start in range(1, len(parts)):
            found[".".join(parts[start:])].append(info.name)
    return found


def _resolves(module_name: str, attributes: list[str]) -> bool:
    target: object = importlib.import_module(module_name)
    for attribute in attributes:
        if isinstance(target, ModuleType) and not hasattr(target, attribute):
            try:
                target = importlib.import_module(f"{target.__name__}.{attribute}")
            except ImportError:
                return False
            continue
        if not hasattr(target, attribute):
            return False
        target = getattr(target, attribute)
    return True


def _doc_names() -> list[tuple[str, str]]:
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    names: list[tuple[str, str]] = []
    for page in pages:
        for match in _DOTTED.finditer(page.read_text(encoding="utf-8")):
            name = match.group(1)
            if name.rsplit(".", 1)[1] in _SUFFIXES:
                continue
            names.append((str(page.relative_to(REPO)), name))
    return names


def _unresolved(modules: dict[str, list[str]]) -> list[str]:
    problems = []
    for page, name in _doc_names():
        parts = name.split(".")
        # The longest leading run of parts that names a module decides which module it means.
        for cut in range(len(parts) - 1, 0, -1):
            head = ".".join(parts[:cut])
            if head in modules and head not in _NOT_CODE:
                if not any(_resolves(full, parts[cut:]) for full in modules[head]):
                    problems.append(f"{page}: `{name}`")
                break
    return problems


def test_every_dotted_name_of_the_package_in_the_docs_resolves() -> None:
    problems = _unresolved(_modules_by_short_name())
    assert not problems, "names the code no longer has:\n" + "\n".join(problems)


def test_a_stale_name_is_caught() -> None:
    modules = _modules_by_short_name()
    assert modules["route_table"] == ["deepinfer_server.api.route_table"]
    assert _resolves("deepinfer_server.api.route_table", ["ROUTES"])
    assert not _resolves("deepinfer_server.api.route_table", ["NO_SUCH_TABLE"])
    assert _resolves("deepinfer_server", ["api", "route_table", "ROUTES"])

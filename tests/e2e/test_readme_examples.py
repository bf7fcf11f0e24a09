"""Every shell and Python example in README.md and the documentation site's pages runs as written
against a simulated server.

The pages are docs/**/*.md except docs/design/, whose code blocks are design sketches. Blocks that
cannot run here carry a marker line just above them:
`<!-- readme-test: skip (reason) -->`, or `<!-- readme-test: needs MODULE -->` for a block that
runs only when an optional package is installed. `localhost:8000` in a block becomes the test
server's address; everything else runs unchanged.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.lanes import GRAMMAR_REASON, require_lane
from tests.paths import REPO
from tests.server import LiveServer

README = REPO / "README.md"
PAGES = [
    README,
    *sorted(p for p in (REPO / "docs").rglob("*.md") if p.relative_to(REPO).parts[1] != "design"),
]
_BLOCK = re.compile(
    r"(?:<!-- readme-test: (?P<marker>[^>]*) -->\n)?```(?P<lang>bash|python)\n(?P<code>.*?)```",
    re.S,
)


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    lang: str
    code: str
    marker: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}-{self.lang}"


def _examples(page: Path) -> list[Example]:
    text = page.read_text(encoding="utf-8")
    name = page.relative_to(REPO).as_posix()
    return [
        Example(name, text.count("\n", 0, m.start()) + 1, m["lang"], m["code"], m["marker"] or "")
        for m in _BLOCK.finditer(text)
    ]


EXAMPLES = [example for page in PAGES for example in _examples(page)]
#: An example's `needs MODULE`: the lane that installs the module, and how.
_NEEDS = {
    "xgrammar": ("grammar", GRAMMAR_REASON),
    "litellm": ("clients", "litellm is not installed (run scripts/install-test-clients.sh)"),
}
_ERROR_BODY = re.compile(r'"error"\s*:\s*\{')


def _with_its_lane(example: Example) -> Any:
    """The example as a test parameter, marked with the lane its `needs MODULE` names."""
    module = example.marker.split()[1] if example.marker.startswith("needs ") else None
    lane = _NEEDS[module][0] if module in _NEEDS else None
    marks = [getattr(pytest.mark, lane)] if lane is not None else []
    return pytest.param(example, marks=marks, id=example.id)


@pytest.fixture(scope="module")
def readme_server() -> Iterator[LiveServer]:
    with LiveServer("--sim-itl-ms", "1", "--sim-ttft-ms", "1") as server:
        yield server


def test_the_readme_and_the_docs_have_runnable_examples_of_each_kind() -> None:
    runnable = [e for e in EXAMPLES if not e.marker.startswith("skip")]
    assert {e.lang for e in runnable} == {"bash", "python"}
    assert {e.lang for e in runnable if e.page == "README.md"} == {"bash", "python"}
    assert len(runnable) >= 15
    assert len({e.page for e in runnable}) >= 8


def test_the_readme_is_a_landing_page_with_the_fresh_machine_commands_first() -> None:
    first_two = [e.code.strip() for e in EXAMPLES if e.page == "README.md"][:2]
    assert first_two == [
        "python3 -m venv .venv && .venv/bin/pip install '.[grammar]' && "
        ".venv/bin/deepinfer-server --engine simulated",
        "python3 -m venv .venv && .venv/bin/pip install '.[test]' && .venv/bin/python -m pytest",
    ]
    assert README.read_text(encoding="utf-8").count("\n") <= 200


@pytest.mark.parametrize("example", [_with_its_lane(e) for e in EXAMPLES])
def test_readme_example_runs(example: Example, readme_server: LiveServer) -> None:
    if example.marker.startswith("skip"):
        pytest.skip(example.marker)
    if example.marker.startswith("needs "):
        module = example.marker.split()[1]
        lane, reason = _NEEDS.get(module, (module, f"{module} is not installed"))
        require_lane(lane, importlib.util.find_spec(module) is not None, reason)
    code = example.code.replace("localhost:8000", f"127.0.0.1:{readme_server.port}")
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # offline: no fetch of LiteLLM's cost map
    }
    command = ["bash", "-euo", "pipefail", "-c", code]
    if example.lang == "python":
        command = [sys.executable, "-c", code]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    where = f"{example.page} line {example.line}"
    assert result.returncode == 0, f"{where} failed:\n{output}"
    assert not _ERROR_BODY.search(result.stdout), f"{where}: an error:\n{output}"

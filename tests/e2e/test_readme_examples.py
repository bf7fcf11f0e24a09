"""Every shell and Python example in README.md runs as written against a simulated server.

Blocks that cannot run here carry a marker line just above them:
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

import pytest

from tests.paths import REPO
from tests.server import LiveServer

README = REPO / "README.md"
_BLOCK = re.compile(
    r"(?:<!-- readme-test: (?P<marker>[^>]*) -->\n)?```(?P<lang>bash|python)\n(?P<code>.*?)```",
    re.S,
)


@dataclass(frozen=True)
class Example:
    line: int
    lang: str
    code: str
    marker: str

    @property
    def id(self) -> str:
        return f"{self.lang}-line{self.line}"


def _examples() -> list[Example]:
    text = README.read_text(encoding="utf-8")
    return [
        Example(text.count("\n", 0, m.start()) + 1, m["lang"], m["code"], m["marker"] or "")
        for m in _BLOCK.finditer(text)
    ]


EXAMPLES = _examples()
_ERROR_BODY = re.compile(r'"error"\s*:\s*\{')


@pytest.fixture(scope="module")
def readme_server() -> Iterator[LiveServer]:
    with LiveServer("--sim-itl-ms", "1", "--sim-ttft-ms", "1") as server:
        yield server


def test_the_readme_has_runnable_examples_of_each_kind() -> None:
    runnable = [e for e in EXAMPLES if not e.marker.startswith("skip")]
    assert {e.lang for e in runnable} == {"bash", "python"}
    assert len(runnable) >= 5


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_readme_example_runs(example: Example, readme_server: LiveServer) -> None:
    if example.marker.startswith("skip"):
        pytest.skip(example.marker)
    if example.marker.startswith("needs "):
        module = example.marker.split()[1]
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
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
    result = subprocess.run(
        command, cwd=README.parent, env=env, capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"README line {example.line} failed:\n{output}"
    assert not _ERROR_BODY.search(result.stdout), f"README line {example.line}: an error:\n{output}"

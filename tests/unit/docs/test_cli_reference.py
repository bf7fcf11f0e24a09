"""The documentation's command-line reference is generated from the server's own parser."""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType

from deepinfer_server.cli import build_parser
from tests.paths import REPO

HOOK = REPO / "scripts" / "mkdocs_cli_reference.py"
PAGE = REPO / "docs" / "operations" / "command-line.md"


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mkdocs_cli_reference", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_lists_every_option_with_its_expanded_help() -> None:
    rendered = _hook().render_options()
    first_cells = [row.split(" | ")[0] for row in rendered.splitlines() if row.startswith("| `")]
    spans = {span for cell in first_cells for span in re.findall(r"`([^`]+)`", cell)}
    listed = {span for span in spans if span.startswith("-") or span == "MODEL"}
    flags = {flag for action in build_parser()._actions for flag in action.option_strings}
    assert listed == flags | {"MODEL"}
    assert "%(" not in rendered  # argparse's placeholders are expanded, as `--help` does
    assert "| `--port` `N` | 8000 | HTTP port; 0 takes a free one" in rendered
    assert "| `--expert-parallel-size`, `--ep` `N` | DP\\*CP |" in rendered
    assert "| `--engine` `{deepinfer,simulated}` | deepinfer |" in rendered
    assert "## --engine simulated" in rendered and "`--sim-itl-ms` `F` | 10.0 |" in rendered


def test_the_command_line_page_gets_the_generated_tables() -> None:
    hook = _hook()
    page = PAGE.read_text(encoding="utf-8")
    assert page.count(hook.MARKER) == 1
    built = hook.on_page_markdown(page)
    assert hook.MARKER not in built
    assert "`--max-num-seqs` `N` | 16 |" in built
    assert hook.on_page_markdown("# Another page\n") == "# Another page\n"

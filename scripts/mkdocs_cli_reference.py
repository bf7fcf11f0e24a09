"""MkDocs hook: the command-line reference, rendered from the server's own argument parser.

A page that holds the line `<!-- cli-options -->` gets, in its place, one table per option group
of `deepinfer-server`'s parser (`cli.build_parser()`, generated from `ServerConfig` and every
engine backend's options), so the reference cannot drift from `--help`. Also runnable on its
own: `python scripts/mkdocs_cli_reference.py` prints the tables.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from deepinfer_server.cli import build_parser

MARKER = "<!-- cli-options -->"
_DEFAULT = re.compile(r"\s*\(default: (?P<default>[^();]*)(?:; (?P<rest>[^()]*))?\)")
_VALUE_NAMES = {int: "N", float: "F"}


def _expanded_help(action: argparse.Action, prog: str) -> str:
    """The help text as `--help` prints it (argparse's own `%(default)s` expansion)."""
    params: dict[str, Any] = {**vars(action), "prog": prog}
    if action.choices is not None:
        params["choices"] = ", ".join(str(choice) for choice in action.choices)
    return (action.help or "") % params


def _invocation(action: argparse.Action) -> str:
    """`--flag`, `--alias` `VALUE`: each flag, then what follows them (choices, N, F or VALUE),
    as separate code spans so that a narrow column breaks between them, never inside one."""
    if not action.option_strings:
        return f"`{str(action.dest).upper()}`"
    flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
    if action.nargs == 0:
        return flags
    if action.choices is not None:
        value = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    else:
        value = _VALUE_NAMES.get(action.type, "VALUE")  # type: ignore[call-overload]
    if action.nargs == "+":
        value = f"{value} [{value} ...]"
    return f"{flags} `{value}`"


def _default(action: argparse.Action, help_text: str) -> tuple[str, str]:
    """The default column, and the help without its `(default: ...)` (what follows a `;` in
    those parentheses stays)."""
    match = _DEFAULT.search(help_text)
    if match:
        rest = f" ({match['rest']})" if match["rest"] else ""
        return match["default"], help_text[: match.start()] + rest + help_text[match.end() :]
    if action.nargs == 0 and action.default is False:
        return "off", help_text
    return "", help_text


def _escape(text: str) -> str:
    """Markdown-escape what the help texts may hold, outside their `code` spans."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts lie outside backticks
        parts[i] = re.sub(r"([\\*_\[\]<>|])", r"\\\1", parts[i])
    return "`".join(parts)


def _table(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> str:
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for action in actions:
        if action.help == argparse.SUPPRESS:
            continue
        default, meaning = _default(action, _expanded_help(action, parser.prog))
        rows.append(f"| {_invocation(action)} | {_escape(default)} | {_escape(meaning)} |")
    return "\n".join(rows)


def render_options(parser: argparse.ArgumentParser | None = None) -> str:
    """Markdown: one section and table per option group of the parser, in `--help`'s order."""
    parser = parser or build_parser()
    sections = []
    for group in parser._action_groups:  # argparse keeps its groups only here
        if not group._group_actions:
            continue
        title = group.title or ""
        heading = f"## {title[0].upper()}{title[1:]}"
        summary = group.description or ""
        description = f"\n\n{_escape(summary[:1].upper() + summary[1:])}." if summary else ""
        table = _table(parser, group._group_actions)
        # md_in_html renders the table inside the div; the class keeps each option on one line.
        sections.append(
            f'{heading}{description}\n\n<div class="cli-options" markdown>\n\n{table}\n\n</div>'
        )
    return "\n\n".join(sections)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs hook: replace the marker line with the generated option tables."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render_options())


if __name__ == "__main__":
    print(render_options())

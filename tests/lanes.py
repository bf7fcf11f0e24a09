"""The optional lanes: tests whose dependency (an extra, a system package, a built tool) may be
missing. Where it is, the test skips, saying why and how to install it, except with
`DEEPINFER_SERVER_REQUIRE_LANES=1` (`.ci/run` sets it), where the same test fails: there every
lane is installed, and a lane that quietly skipped would pass for one that ran.

Every "lane dependency missing" skip goes through `missing_lane` (or `require_lane`,
`import_lane`, `require_grammar`), so the switch reaches them all.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

#: Set to 1 where every lane must run: a missing lane dependency fails instead of skipping.
REQUIRE_LANES = "DEEPINFER_SERVER_REQUIRE_LANES"

GRAMMAR_REASON = "structured output needs the [grammar] extra (pip install '.[test,grammar]')"
DISAGGREGATION_REASON = (
    "needs Mooncake's Transfer Engine: the disaggregation extra (pip install "
    "'.[disaggregation]') and Debian's libibverbs1 (scripts/install-mooncake-deps.sh)"
)


def lanes_required() -> bool:
    """Whether a missing lane dependency fails the test rather than skipping it."""
    return os.environ.get(REQUIRE_LANES) == "1"


def _message(lane: str, reason: str) -> str:
    return f"{lane} lane: {reason}"


def _required(message: str) -> str:
    return f"{message} ({REQUIRE_LANES}=1: every lane must run)"


# The helpers hide their frames from pytest's reports, so a skip is reported at the line of the
# test (or module) that needs the lane.


def missing_lane(lane: str, reason: str) -> NoReturn:
    """Skip the test (or the module, at module level) for want of `lane`, saying why; fail it
    where every lane is required."""
    __tracebackhide__ = True
    if lanes_required():
        pytest.fail(_required(_message(lane, reason)), pytrace=False)
    pytest.skip(_message(lane, reason), allow_module_level=True)


def require_lane(lane: str, available: bool, reason: str) -> None:
    """`missing_lane(lane, reason)` unless `available`."""
    __tracebackhide__ = True
    if not available:
        missing_lane(lane, reason)


def import_lane(lane: str, module: str, reason: str) -> ModuleType:
    """`module`, imported; `missing_lane` if it cannot be (pytest.importorskip, under the
    switch)."""
    __tracebackhide__ = True
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = str(exc)
    missing_lane(lane, f"{reason} ({missing})")  # outside the except: no chained traceback


def require_grammar() -> None:
    """The grammar lane: structured output needs xgrammar."""
    __tracebackhide__ = True
    import_lane("grammar", "xgrammar", GRAMMAR_REASON)


def require_disaggregation() -> None:
    """The disaggregation lane: Mooncake's Transfer Engine (its engine module loads
    libibverbs)."""
    __tracebackhide__ = True
    import_lane("disaggregation", "mooncake.engine", DISAGGREGATION_REASON)


_MISSING = pytest.StashKey[str]()


def mark_missing_lane(item: pytest.Item, lane: str, reason: str) -> None:
    """At collection, for a test whose marker names a lane that is missing: it skips (reported
    at the test, as a skip marker is), or fails under the switch (`fail_missing_lane`); either
    before any of its fixtures starts a server."""
    if lanes_required():
        item.stash[_MISSING] = _required(_message(lane, reason))
    else:
        item.add_marker(pytest.mark.skip(reason=_message(lane, reason)))


def fail_missing_lane(item: pytest.Item) -> None:
    """At set-up: fail a test `mark_missing_lane` found without its lane under the switch."""
    message = item.stash.get(_MISSING, None)
    if message is not None:
        pytest.fail(message, pytrace=False)

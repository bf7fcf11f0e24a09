"""Structured outputs and forced tool calls through DeepInfer's grammar engine (xgrammar).

xgrammar is optional (the [grammar] extra); without it every entry point that needs it raises
GrammarUnavailable. Reading requests (`chat_constraint` and siblings) never needs it.
"""

from __future__ import annotations

from deepinfer_server.grammar._xgr import Vocab, VocabSource
from deepinfer_server.grammar.compiler import GrammarBounds, GrammarCompiler, engine_env_defaults
from deepinfer_server.grammar.constraint import (
    Constraint,
    ToolConstraint,
    ToolSpec,
    chat_constraint,
    in_thinking_mode,
    messages_constraint,
    responses_constraint,
)
from deepinfer_server.grammar.errors import GrammarError, GrammarUnavailable
from deepinfer_server.grammar.matcher import MatcherFailure, SimulatedMatcher
from deepinfer_server.grammar.so_args import build_so_args

__all__ = [
    "Constraint",
    "GrammarBounds",
    "GrammarCompiler",
    "GrammarError",
    "GrammarUnavailable",
    "MatcherFailure",
    "SimulatedMatcher",
    "ToolConstraint",
    "ToolSpec",
    "Vocab",
    "VocabSource",
    "build_so_args",
    "chat_constraint",
    "engine_env_defaults",
    "in_thinking_mode",
    "messages_constraint",
    "responses_constraint",
]

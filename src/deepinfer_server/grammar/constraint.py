"""What a request asks to constrain, read from raw request bodies of every protocol.

The readers take the decoded JSON body (a dict) and return a `Constraint` or None, not yet in
thinking mode: only the recipe's converted conversation knows the mode, which
`in_thinking_mode` sets. Bad options raise GrammarError naming the request field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from deepinfer_server.grammar.errors import GrammarError

Kind = Literal["json_schema", "json_object", "regex", "ebnf", "choice"]
ToolMode = Literal["required", "named", "strict_auto", "auto"]
_VLLM_KEYS: dict[str, Kind] = {
    "json": "json_schema",
    "regex": "regex",
    "grammar": "ebnf",
    "choice": "choice",
}
_GUIDED_KEYS: dict[str, Kind] = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
    "guided_choice": "choice",
}


@dataclass(frozen=True)
class ToolSpec:
    """One function tool: its name and its parameters' JSON schema (as compact JSON text)."""

    name: str
    parameters: str
    strict: bool = False


@dataclass(frozen=True)
class ToolConstraint:
    """The tool-call part of a constraint.

    mode: `required` (some tool call), `named` (a call of `name`), `strict_auto` (free text, but
    a tool-call block must follow the schemas), `auto` (only with an answer format: the answer
    is the format or a tool-call block).
    """

    tools: tuple[ToolSpec, ...]
    mode: ToolMode
    name: str | None = None
    parallel: bool = True

    @property
    def allowed(self) -> tuple[ToolSpec, ...]:
        """The tools a call may name."""
        if self.mode == "named":
            return tuple(tool for tool in self.tools if tool.name == self.name)
        return self.tools


@dataclass(frozen=True)
class Constraint:
    """A request's structured-output constraint, protocol-neutral.

    kind/spec describe the answer format (spec: schema JSON, regex, EBNF, or a JSON list of
    choices); kind is None when only tools are constrained. `param` is the request field the
    format came from (for error messages).
    """

    kind: Kind | None
    spec: str
    tools: ToolConstraint | None
    param: str = "response_format"
    #: Whether the answer follows the request's reasoning (`in_thinking_mode`).
    thinking: bool = False


def in_thinking_mode(constraint: Constraint | None, thinking: bool) -> Constraint | None:
    """The constraint for a request converted in thinking mode (`thinking`) or not."""
    if constraint is None or constraint.thinking == thinking:
        return constraint
    return dataclasses.replace(constraint, thinking=thinking)


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}", param) from exc
    if isinstance(value, bool):
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise GrammarError("the JSON schema must be an object", param)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _json_schema_format(fmt: Mapping[str, Any], schema: Any, param: str) -> tuple[Kind, str]:
    if schema is None:
        raise GrammarError("a json_schema format needs a 'schema'", param)
    return "json_schema", _schema_text(schema, param)


def _answer_format(fmt: Any, param: str, schema_holder: str | None) -> tuple[Kind, str] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise GrammarError(f"'{param}' must be an object", param)
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json_object", '{"type":"object"}'
    if kind == "json_schema":
        holder = fmt.get(schema_holder) if schema_holder else fmt
        if not isinstance(holder, dict):
            raise GrammarError(f"'{param}.{schema_holder}' must be an object", param)
        return _json_schema_format(fmt, holder.get("schema"), param)
    raise GrammarError(f"{param} type {kind!r} is not supported", param)


def _vllm_format(body: Mapping[str, Any]) -> tuple[Kind, str, str] | None:
    found: list[tuple[Kind, Any, str]] = []
    options = body.get("structured_outputs")
    if options is not None:
        if not isinstance(options, dict):
            raise GrammarError("'structured_outputs' must be an object", "structured_outputs")
        for key, kind in _VLLM_KEYS.items():
            if options.get(key) is not None:
                found.append((kind, options[key], f"structured_outputs.{key}"))
        if options.get("json_object"):
            found.append(("json_object", None, "structured_outputs.json_object"))
    for key, kind in _GUIDED_KEYS.items():
        if body.get(key) is not None:
            found.append((kind, body[key], key))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(param for _, _, param in found)
        raise GrammarError(f"only one structured output may be given, got {names}", found[1][2])
    kind, value, param = found[0]
    if kind == "json_object":
        return kind, '{"type":"object"}', param
    if kind == "json_schema":
        return kind, _schema_text(value, param), param
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise GrammarError("choice must be a non-empty list of strings", param)
        return kind, json.dumps(value, ensure_ascii=False), param
    if not isinstance(value, str) or not value:
        raise GrammarError(f"'{param}' must be a non-empty string", param)
    return kind, value, param


def _tool(name: Any, parameters: Any, strict: Any, param: str) -> ToolSpec:
    if not isinstance(name, str) or not name:
        raise GrammarError("every function tool needs a name", param)
    schema = {"type": "object", "properties": {}} if parameters is None else parameters
    return ToolSpec(name, _schema_text(schema, param), strict is True)


def _chat_tools(tools: Any, strict_default: bool, flat: bool) -> tuple[ToolSpec, ...]:
    specs: list[ToolSpec] = []
    for index, tool in enumerate(tools if isinstance(tools, list) else []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            continue
        fn = tool if flat else tool.get("function")
        if not isinstance(fn, dict):
            continue
        strict = fn.get("strict", strict_default)
        specs.append(_tool(fn.get("name"), fn.get("parameters"), strict, f"tools[{index}]"))
    return tuple(specs)


def _anthropic_tools(tools: Any) -> tuple[ToolSpec, ...]:
    specs: list[ToolSpec] = []
    for index, tool in enumerate(tools if isinstance(tools, list) else []):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            continue
        param = f"tools[{index}]"
        specs.append(_tool(tool.get("name"), tool.get("input_schema"), tool.get("strict"), param))
    return tuple(specs)


def _tool_constraint(
    tools: tuple[ToolSpec, ...],
    mode: str,
    name: str | None,
    parallel: bool,
    has_format: bool,
) -> ToolConstraint | None:
    if mode == "none":
        return None
    if mode in ("required", "named") and not tools:
        raise GrammarError(f"tool_choice '{mode}' needs at least one function tool", "tool_choice")
    if mode == "named":
        if not any(tool.name == name for tool in tools):
            raise GrammarError(f"tool_choice names an unknown tool {name!r}", "tool_choice")
        return ToolConstraint(tools, "named", name, parallel)
    if mode == "required":
        return ToolConstraint(tools, "required", None, parallel)
    if not tools:
        return None
    if any(tool.strict for tool in tools):
        return ToolConstraint(tools, "strict_auto", None, parallel)
    return ToolConstraint(tools, "auto", None, parallel) if has_format else None


def _combine(
    fmt: tuple[Kind, str] | None, param: str, tools: ToolConstraint | None
) -> Constraint | None:
    if fmt is None and tools is None:
        return None
    if fmt is None or (tools is not None and tools.mode in ("required", "named")):
        # A forced tool call is the whole answer; an answer format applies to text answers.
        return Constraint(None, "", tools, "tool_choice")
    return Constraint(fmt[0], fmt[1], tools, param)


def _openai_choice(choice: Any, flat: bool) -> tuple[str, str | None]:
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        return str(choice), None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice if flat else choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str):
            return "named", name
    if isinstance(choice, dict) and choice.get("type") in ("auto", "none", "required"):
        return str(choice["type"]), None
    raise GrammarError(f"unsupported tool_choice {choice!r}", "tool_choice")


def chat_constraint(body: Mapping[str, Any]) -> Constraint | None:
    """Chat Completions: response_format, vLLM structured_outputs/guided_*, tool_choice, strict
    tools."""
    fmt = _answer_format(body.get("response_format"), "response_format", "json_schema")
    param = "response_format"
    vllm = _vllm_format(body)
    if vllm is not None:
        if fmt is not None:
            raise GrammarError("give either response_format or structured_outputs", vllm[2])
        fmt, param = (vllm[0], vllm[1]), vllm[2]
    mode, name = _openai_choice(body.get("tool_choice"), flat=False)
    parallel = body.get("parallel_tool_calls") is not False
    tools = _tool_constraint(
        _chat_tools(body.get("tools"), False, flat=False), mode, name, parallel, fmt is not None
    )
    return _combine(fmt, param, tools)


def responses_constraint(body: Mapping[str, Any]) -> Constraint | None:
    """Responses: text.format, tool_choice ("required", {"type":"function","name"}), tools
    (function tools are strict unless they say `strict: false`, as in OpenAI's API)."""
    text = body.get("text")
    fmt = _answer_format(
        text.get("format") if isinstance(text, dict) else None, "text.format", None
    )
    mode, name = _openai_choice(body.get("tool_choice"), flat=True)
    parallel = body.get("parallel_tool_calls") is not False
    tools = _tool_constraint(
        _chat_tools(body.get("tools"), True, flat=True), mode, name, parallel, fmt is not None
    )
    return _combine(fmt, "text.format", tools)


def messages_constraint(body: Mapping[str, Any]) -> Constraint | None:
    """Anthropic Messages: output_config.format (or the older output_format) and tool_choice
    {"type": "any"} / {"type": "tool", "name"}; tools with `strict: true`."""
    config = body.get("output_config")
    raw_format = config.get("format") if isinstance(config, dict) else None
    param = "output_config.format"
    if raw_format is None and body.get("output_format") is not None:
        raw_format, param = body.get("output_format"), "output_format"
    fmt = _answer_format(raw_format, param, None)
    choice = body.get("tool_choice")
    mode, name, parallel = "auto", None, True
    if choice is not None:
        if not isinstance(choice, dict):
            raise GrammarError("'tool_choice' must be an object", "tool_choice")
        kind = choice.get("type")
        mode = {"any": "required", "tool": "named", "auto": "auto", "none": "none"}.get(
            str(kind), ""
        )
        if not mode:
            raise GrammarError(f"unsupported tool_choice type {kind!r}", "tool_choice")
        name = choice.get("name") if mode == "named" else None
        parallel = choice.get("disable_parallel_tool_use") is not True
    tools = _tool_constraint(
        _anthropic_tools(body.get("tools")), mode, name, parallel, fmt is not None
    )
    return _combine(fmt, param, tools)

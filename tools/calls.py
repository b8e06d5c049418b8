"""run_tool_call: one tool call as the model wrote it -> the text the model reads back.

`call` is the text between `<tool_call>` and `</tool_call>` in a Qwen3 completion: a JSON object
`{"name": ..., "arguments": {...}}`. Everything about it is untrusted model text: it is only ever parsed as JSON,
never executed. Whatever is wrong -- not JSON, not an object, no name, an unknown tool, arguments that are not an
object or do not fit the tool's schema, a tool that raises, hangs or answers at length -- the answer is text
(`error: ...` for a failure) and nothing is raised, so one bad call never stops a rollout."""
from __future__ import annotations

import json

from tools.isolation import bounded, call_bounded
from tools.registry import ToolRegistry, check_arguments


def parse_call(registry: ToolRegistry, call: str) -> tuple[str, dict] | str:
    """(tool name, arguments) of a well-formed call to a registered tool, or the error text saying what is wrong."""
    try:
        parsed = json.loads(call)
    # RecursionError: json's decoder on thousands of nested brackets; TypeError: a call that is not text at all
    except (ValueError, RecursionError, TypeError) as error:
        return f"error: the tool call is not JSON ({error})"
    if not isinstance(parsed, dict):
        return (f'error: the tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, '
                f'not {type(parsed).__name__}')
    name, arguments = parsed.get("name"), parsed.get("arguments")
    if not isinstance(name, str):
        return 'error: the tool call has no "name" string'
    tool = registry.get(name)
    if tool is None:
        return f"error: unknown tool {name!r} (the tools: {', '.join(registry.tools) or 'none'})"
    if not isinstance(arguments, dict):
        return f'error: the tool call\'s "arguments" must be a JSON object, not {type(arguments).__name__}'
    problem = check_arguments(tool, arguments)
    return f"error: {problem}" if problem else (name, arguments)


def run_tool_call(registry: ToolRegistry, call: str) -> str:
    """The text the model reads back for one tool call: the tool's answer, or `error: ...`; at most the registry's
    max_result_chars (and a marker), within its timeout_s. Nothing in the call or the tool makes it raise; only a
    machine that cannot start a process at all raises (OSError from fork), as an environment failure should."""
    parsed = parse_call(registry, call)
    if isinstance(parsed, str):
        return bounded(parsed, registry.max_result_chars)
    name, arguments = parsed
    return call_bounded(registry.get(name).function, arguments, registry.timeout_s, registry.max_result_chars)

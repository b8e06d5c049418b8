"""What a tool is and the registry that holds them by name.

A tool is a name, an OpenAI function-tool schema (`Tool.schema()`, the form a chat template's `tools=` takes) and a
Python function that receives the parsed arguments dict and returns a string. `check_arguments` holds a call's
arguments to the schema's top level before the function ever sees them: the required keys, the JSON type of each
declared property, and no undeclared key when the schema says `"additionalProperties": false`. Deeper structure
(an array's items, a nested object) is the tool's own to check."""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_RESULT_CHARS = 2000
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name

# JSON schema's types as Python's json module parses them; bool is an int in Python, so it is kept out of the numbers
JSON_TYPES: dict[str, Callable[[object], bool]] = {
    "string": lambda value: isinstance(value, str),
    "integer": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "number": lambda value: isinstance(value, (int, float)) and not isinstance(value, bool),
    "boolean": lambda value: isinstance(value, bool),
    "object": lambda value: isinstance(value, dict),
    "array": lambda value: isinstance(value, list),
    "null": lambda value: value is None,
}


@dataclass(frozen=True)
class Tool:
    """One tool: `function(arguments) -> str` is called with arguments that passed `check_arguments`."""
    name: str
    description: str
    parameters: dict  # a JSON schema of type "object"
    function: Callable[[dict], str]

    def __post_init__(self):
        if not NAME.fullmatch(self.name):
            raise ValueError(f"tool name {self.name!r}: 1-64 characters of letters, digits, '_' or '-'")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: its parameters must be a JSON schema of type 'object'")
        for key, spec in self.parameters.get("properties", {}).items():
            types = spec.get("type", [])
            unknown = [t for t in ([types] if isinstance(types, str) else types) if t not in JSON_TYPES]
            if unknown:
                raise ValueError(f"tool {self.name!r}, property {key!r}: unknown JSON type(s) {unknown}")

    def schema(self) -> dict:
        """The OpenAI function-tool form: {"type": "function", "function": {name, description, parameters}}."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def check_arguments(tool: Tool, arguments: dict) -> str | None:
    """What is wrong with `arguments` for `tool`'s schema (its top level: see the module docstring), or None."""
    properties = tool.parameters.get("properties", {})
    missing = [key for key in tool.parameters.get("required", []) if key not in arguments]
    if missing:
        return f"{tool.name} needs the argument(s) {', '.join(missing)}"
    if tool.parameters.get("additionalProperties") is False:
        unknown = [key for key in arguments if key not in properties]
        if unknown:
            return f"{tool.name} takes no argument(s) {', '.join(unknown)} (it takes: {', '.join(properties)})"
    for key, value in arguments.items():
        types = properties.get(key, {}).get("type")
        if types is None:
            continue
        types = [types] if isinstance(types, str) else types
        if not any(JSON_TYPES[t](value) for t in types):
            return f"{tool.name}'s argument {key} must be of type {' or '.join(types)}, not {type(value).__name__}"
    return None


class ToolRegistry:
    """The tools a rollout may call, by name, and the bounds every call runs under (see tools/calls.py)."""

    def __init__(self, tools: Sequence[Tool] = (), timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_result_chars: int = DEFAULT_MAX_RESULT_CHARS):
        if timeout_s <= 0 or max_result_chars <= 0:
            raise ValueError("a tool registry needs timeout_s > 0 and max_result_chars > 0")
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        """Register `tool`; a second tool of the same name is refused rather than silently replacing the first."""
        if tool.name in self.tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered")
        self.tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self.tools.get(name)

    def schemas(self) -> list[dict]:
        """Every tool's OpenAI schema, in the order added: what the chat template's `tools=` takes."""
        return [tool.schema() for tool in self.tools.values()]

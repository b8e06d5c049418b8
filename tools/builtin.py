"""The tools the loops' and eval's --tools flag can name, and the function that answers a rollout's calls with
them."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from tools.calculator import CALCULATOR
from tools.calls import run_tool_call
from tools.registry import ToolRegistry

# by name: add your own here to make --tools offer it (docs/tools.md)
BUILTIN_TOOLS = {tool.name: tool for tool in [CALCULATOR]}


def tool_names(flag: str) -> list[str]:
    """A --tools value, comma-separated names, as a list ("" -> [])."""
    return [name for name in flag.split(",") if name]


def unknown_tools(names: Sequence[str]) -> list[str]:
    return [name for name in names if name not in BUILTIN_TOOLS]


def answerer(names: Sequence[str]) -> Callable[[str], str]:
    """call text -> the result text, by a registry of the built-in tools `names` (run_tool_call: never raises)."""
    registry = ToolRegistry([BUILTIN_TOOLS[name] for name in names])
    return lambda call: run_tool_call(registry, call)

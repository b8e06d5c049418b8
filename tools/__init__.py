"""Tools a model may call during a rollout: the registry (registry.py), one call run and bounded (calls.py,
isolation.py), the built-in calculator (calculator.py) and the tools --tools can name (builtin.py). It may import
common alone (tests/test_layering.py), so that serving, trainer and eval can all import it (docs/tools.md)."""
from tools.builtin import BUILTIN_TOOLS, answerer, tool_names, unknown_tools
from tools.calculator import CALCULATOR
from tools.calls import run_tool_call
from tools.registry import Tool, ToolRegistry

__all__ = ["BUILTIN_TOOLS", "CALCULATOR", "Tool", "ToolRegistry", "answerer", "run_tool_call", "tool_names",
           "unknown_tools"]

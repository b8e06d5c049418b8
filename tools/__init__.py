"""Tools a model may call during a rollout: the registry (registry.py), one call run and bounded (calls.py,
isolation.py) and the built-in calculator (calculator.py). It may import common alone (tests/test_layering.py), so that
serving, trainer and eval can all import it (docs/tools.md)."""
from tools.calculator import CALCULATOR
from tools.calls import run_tool_call
from tools.registry import Tool, ToolRegistry

__all__ = ["CALCULATOR", "Tool", "ToolRegistry", "run_tool_call"]

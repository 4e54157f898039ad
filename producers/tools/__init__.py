"""Tools an agent loop can call: the built-in calculator and user tools loaded by import path."""

from rlbus.producers.tools.calculator import CALCULATOR, evaluate
from rlbus.producers.tools.registry import Tool, load_tool, load_tools

__all__ = ["CALCULATOR", "Tool", "evaluate", "load_tool", "load_tools"]

"""The tool registry: built-in tools by name, user tools by import path ("pkg.module:attr").

`rollout.tools: [calculator, mypkg.search:SEARCH]` in a run config becomes `load_tools(cfg.rollout.tools)`, a
name -> Tool mapping the agent loop dispatches `<tool_call>` names to. A user tool is any object with `name`,
`description` and a `__call__(arguments: dict) -> str`, async or not (a synchronous one runs in the producer's worker
pool, off its event loop); a class or a zero-argument factory is instantiated. It may declare `max_concurrency`,
`timeout_s` and `retries` (producers/tools/runner.py says what each does).

    .venv/bin/python -m pytest -q tests/unit/test_agent_loop.py
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Protocol, runtime_checkable

from rlbus.common.imports import import_object
from rlbus.producers.tools.calculator import CALCULATOR
from rlbus.schemas.errors import ConfigError


@runtime_checkable
class Tool(Protocol):
    """A tool the model can call. The returned string is shown to the model as the tool response."""

    name: str
    description: str

    def __call__(self, arguments: dict[str, Any]) -> Any: ...  # async, or a plain function run in a worker thread


BUILTIN_TOOLS: dict[str, Callable[[], Tool]] = {"calculator": lambda: CALCULATOR}

__all__ = ["BUILTIN_TOOLS", "Tool", "import_object", "load_tool", "load_tools"]


def load_tool(spec: str) -> Tool:
    """One tool by built-in name or import path."""
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]()
    obj = import_object(spec, "rollout.tools")
    if inspect.isclass(obj) or (callable(obj) and not hasattr(obj, "name")):
        obj = obj()  # a class or a factory function
    missing = [a for a in ("name", "description") if not isinstance(getattr(obj, a, None), str)]
    if missing or not callable(obj):
        raise ConfigError(
            "rollout.tools",
            f"{spec!r} is not a tool: it needs str attributes name and description and an async __call__(arguments)"
            + (f" (missing {', '.join(missing)})" if missing else ""),
        )
    for attr, kind in (("max_concurrency", int), ("retries", int), ("timeout_s", (int, float))):
        value = getattr(obj, attr, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind) or value < 0):
            raise ConfigError("rollout.tools", f"{spec!r}: {attr} must be a number >= 0, got {value!r}")
    return obj


def load_tools(names: list[str]) -> dict[str, Tool]:
    """name -> Tool for every entry of `rollout.tools`; two tools with one name are a config error."""
    tools: dict[str, Tool] = {}
    for spec in names:
        tool = load_tool(spec)
        if tool.name in tools:
            raise ConfigError("rollout.tools", f"two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools

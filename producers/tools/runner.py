"""Calling a tool the way it asks to be called: its concurrency limit, its timeout, its retries, off the event loop.

A tool may declare, as attributes (each optional):

    max_concurrency: int   calls at once across every episode of the producer (a pool of 4 sandboxes: 4); 0 = any
    timeout_s: float       one attempt's limit (default rollout.tool_timeout_s)
    retries: int           attempts after the first when the tool's service fails (default rollout.tool_retries)

A synchronous `__call__` runs in the producer's bounded pool of worker threads (producers/blocking.py), never on the
event loop. What a call comes to is one of three things, and the three are kept apart on purpose:

- a string: the tool's answer, shown to the model (its own "error: ..." answers included: the model's call was bad);
- an exception other than those below: the tool refused the model's arguments; "error: <type>: <message>" is shown
  to the model, as a tool response (the rollout never fails because of what the model wrote);
- `InfrastructureError`, or an attempt past its timeout: the tool's service failed, not the policy. The call is tried
  again, after a backoff, up to `retries` times; then `InfrastructureError` ends the episode and the producer gives
  the task back to be rolled out again: an outage is never trained as a reward of 0.

    .venv/bin/python -m pytest -q tests/unit/test_tool_runner.py
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping

from rlbus.producers.blocking import is_async, run_blocking
from rlbus.producers.tools.registry import Tool
from rlbus.schemas.config import RolloutConfig
from rlbus.schemas.errors import InfrastructureError

log = logging.getLogger(__name__)

#: First backoff between attempts (seconds); doubled each attempt, at most BACKOFF_MAX_S.
BACKOFF_S = 0.25
BACKOFF_MAX_S = 4.0


class ToolRunner:
    """Dispatches calls to the run's tools with each tool's limits. One per agent loop (so per producer)."""

    tools: dict[str, Tool]
    cfg: RolloutConfig
    infra_retries: int  # attempts retried because a tool's service failed (a metric of the producer)
    _limits: dict[str, asyncio.Semaphore]  # tool name -> its max_concurrency (tools that declare one)

    def __init__(self, tools: Mapping[str, Tool], cfg: RolloutConfig):
        self.tools = dict(tools)
        self.cfg = cfg
        self.infra_retries = 0
        self._limits = {name: asyncio.Semaphore(limit) for name, tool in self.tools.items()
                        if (limit := int(getattr(tool, "max_concurrency", 0) or 0)) > 0}

    def timeout_s(self, tool: Tool) -> float:
        return float(getattr(tool, "timeout_s", 0) or self.cfg.tool_timeout_s)

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """The tool's answer for the model; raises InfrastructureError once its service failed every attempt."""
        tool = self.tools.get(name)
        if tool is None:
            return f"error: unknown tool {name!r}; available: {', '.join(sorted(self.tools)) or 'none'}"
        retries = getattr(tool, "retries", None)
        retries = self.cfg.tool_retries if retries is None else int(retries)
        timeout = self.timeout_s(tool)
        failure = ""
        for attempt in range(retries + 1):
            if attempt:
                self.infra_retries += 1
                await asyncio.sleep(min(BACKOFF_S * 2 ** (attempt - 1), BACKOFF_MAX_S))
            try:
                out = await asyncio.wait_for(self._attempt(name, tool, arguments), timeout)
            except asyncio.TimeoutError:
                failure = f"timed out after {timeout:g}s"
            except InfrastructureError as e:
                failure = e.reason
            except Exception as e:  # noqa: BLE001 - the tool refused the model's arguments: an observation
                return f"error: {type(e).__name__}: {e}"
            else:
                return out if isinstance(out, str) else str(out)
            log.info("tool %r: attempt %d of %d failed: %s", name, attempt + 1, retries + 1, failure)
        raise InfrastructureError(f"tool {name}", f"{failure} ({retries + 1} attempt(s))")

    async def _attempt(self, name: str, tool: Tool, arguments: dict[str, Any]) -> Any:
        limit = self._limits.get(name)
        if is_async(tool):
            if limit is None:
                return await tool(arguments)
            async with limit:
                return await tool(arguments)
        return await run_blocking(tool, arguments, limit=limit)


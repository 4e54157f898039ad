"""Workloads of bench/agentic.py: the quickstart's calculator behind a remote service's latency.

`rollout.tools=[bench.agentic_tools:RemoteCalculator]` (from the repository root): the same answers as the built-in
`calculator`, each after a lognormal wait (median RLBUS_TOOL_MEDIAN_S seconds, sigma RLBUS_TOOL_SIGMA, capped at
RLBUS_TOOL_CAP_S), as an HTTP API, a search engine or a sandbox would answer. The wait is `asyncio.sleep`: what
costs time is the waiting, not the computing. Its random stream is seeded per process (RLBUS_TOOL_SEED + pid).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
from typing import Any

from rlbus.producers.tools.calculator import CALCULATOR


class RemoteCalculator:
    name = CALCULATOR.name  # the quickstart model calls "calculator"
    description = CALCULATOR.description
    parameters = CALCULATOR.parameters

    def __init__(self) -> None:
        self.median_s = float(os.environ.get("RLBUS_TOOL_MEDIAN_S", "1.0"))
        self.sigma = float(os.environ.get("RLBUS_TOOL_SIGMA", "1.0"))
        self.cap_s = float(os.environ.get("RLBUS_TOOL_CAP_S", "8.0"))
        self.rng = random.Random(int(os.environ.get("RLBUS_TOOL_SEED", "0")) * 100003 + os.getpid())

    def latency(self) -> float:
        return min(self.cap_s, self.median_s * math.exp(self.rng.gauss(0.0, self.sigma)))

    async def __call__(self, arguments: dict[str, Any]) -> str:
        await asyncio.sleep(self.latency())
        return await CALCULATOR(arguments)

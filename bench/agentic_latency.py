"""The waits of bench/agentic.py's remote services: a lognormal wait, and an environment step's wait with stragglers
and hangs. Standard library only: rlbus's side (bench/agentic_tools.py) and the TRL side (bench/agentic_trl.py, in
the TRL venv, which has no rlbus) draw the same waits from the same variables.

    .venv/bin/python -m pytest -q tests/unit/test_agentic_bench.py
"""

from __future__ import annotations

import math
import os
import random
import threading


def env_float(name: str, default: float) -> float:
    """RLBUS_<name> from the environment, else `default`."""
    return float(os.environ.get(f"RLBUS_{name}", default))


class Lognormal:
    """A service's wait in seconds: median_s * exp(N(0, sigma)), at most cap_s; its own seeded random stream, safe
    to draw from the producer's worker threads at once."""

    median_s: float
    sigma: float
    cap_s: float
    rng: random.Random
    _lock: threading.Lock

    def __init__(self, median_s: float, sigma: float = 1.0, cap_s: float = 8.0, seed: int = 0):
        self.median_s, self.sigma, self.cap_s = median_s, sigma, cap_s
        self.rng = random.Random(seed)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, prefix: str) -> Lognormal:
        """From RLBUS_<prefix>_MEDIAN_S, _SIGMA, _CAP_S and _SEED; the stream is this process's own."""
        return cls(env_float(f"{prefix}_MEDIAN_S", 1.0), env_float(f"{prefix}_SIGMA", 1.0),
                   env_float(f"{prefix}_CAP_S", 8.0), seed=int(env_float(f"{prefix}_SEED", 0)) * 100003 + os.getpid())

    def draw(self) -> float:
        with self._lock:
            return self._draw()

    def _draw(self) -> float:  # the caller holds the lock
        if self.median_s <= 0:
            return 0.0
        return min(self.cap_s, self.median_s * math.exp(self.rng.gauss(0.0, self.sigma)))


class StepLatency:
    """An environment step's wait: the lognormal wait, except that a share `straggle` of steps takes `straggle_s`
    and a share `hang` takes `hang_s` (an hour: a step that hangs until the episode timeout cuts it off)."""

    wait: Lognormal
    straggle: float
    straggle_s: float
    hang: float
    hang_s: float

    def __init__(self, wait: Lognormal, *, straggle: float = 0.0, straggle_s: float = 20.0, hang: float = 0.0,
                 hang_s: float = 3600.0):
        if not (0 <= straggle and 0 <= hang and straggle + hang <= 1):
            raise ValueError(f"RLBUS_ENV_STRAGGLE ({straggle}) and RLBUS_ENV_HANG ({hang}): shares in [0, 1] whose "
                             "sum is at most 1")
        self.wait, self.straggle, self.straggle_s, self.hang, self.hang_s = wait, straggle, straggle_s, hang, hang_s

    @classmethod
    def from_env(cls) -> StepLatency:
        return cls(Lognormal.from_env("ENV"), straggle=env_float("ENV_STRAGGLE", 0.0),
                   straggle_s=env_float("ENV_STRAGGLE_S", 20.0), hang=env_float("ENV_HANG", 0.0),
                   hang_s=env_float("ENV_HANG_S", 3600.0))

    def draw(self) -> float:
        with self.wait._lock:  # one stream: the share and the wait are drawn together
            u = self.wait.rng.random()
            if u < self.hang:
                return self.hang_s
            if u < self.hang + self.straggle:
                return self.straggle_s
            return self.wait._draw()

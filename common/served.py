"""A role that serves HTTP until it is told to stop, its URL in a file of the run directory meanwhile.

The judge (`rlbus judge`) and the Tinker service (`rlbus tinker`) are such roles: clients find the server by reading
the file, which holds the URL whole (written atomically) while the server answers, and is removed first on the way
out (if it still names this server: a successor may have written its own), so that a reader waits for the next
server instead of calling a closing one. bus/loop.py's `serve` drives the lifecycle: start(), run() until SIGTERM /
SIGINT calls stop(), close() on every exit path.

    .venv/bin/python -m pytest -q tests/integration/test_judge.py tests/integration/test_tinker.py
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Protocol

from rlbus.common.files import write_atomic

#: Seconds a server may take to close before the role gives up on it.
CLOSE_TIMEOUT_S = 30.0


class HttpServer(Protocol):
    base_url: str  # "" until started

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class UrlRole:
    """`server` until stop(), its URL in `url_file`. Subclasses say what they log at start and at the end."""

    server: HttpServer
    url_file: Path
    log: logging.Logger
    _stop: asyncio.Event

    def __init__(self, server: HttpServer, url_file: Path, log: logging.Logger):
        self.server, self.url_file, self.log = server, url_file, log
        self._stop = asyncio.Event()

    async def start(self) -> None:
        await self.server.start()
        self.url_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.url_file, self.server.base_url + "\n")  # a reader sees the old URL or the new, whole
        self.started()

    async def run(self) -> None:
        await self._stop.wait()

    def stop(self) -> None:
        self._stop.set()

    async def close(self, reason: str = "", clean: bool = True) -> None:
        with contextlib.suppress(FileNotFoundError):
            if self.server.base_url and self.url_file.read_text().strip() == self.server.base_url:
                self.url_file.unlink()
        await asyncio.wait_for(self.server.close(), timeout=CLOSE_TIMEOUT_S)
        self.stopped(reason or "stopped")

    def started(self) -> None:
        self.log.info("serving on %s (URL in %s)", self.server.base_url, self.url_file)

    def stopped(self, reason: str) -> None:
        self.log.info("stopped (%s)", reason)

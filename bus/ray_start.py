"""`ray start`, less what rlbus's heads never use: `python -m rlbus.bus.ray_start start --head ...` is `ray start ...`.

Two parts of a head's start are left out, because on 2 cores start-up is CPU-bound (docs/benchmarks.md):

- The Ray Client server (the `ray://` proxy). `ray start --head` runs it whenever Ray's client extras are
  importable and has no switch to leave it out (a port of 0 is refused); rlbus's drivers join a head directly
  (`ensure_ray`), never through `ray://`. It cost about 1 CPU-s of every head's start. Ray's CLI is run with its
  probe for the client extras answering that they are missing.
- The API server, with `--include-dashboard=false`. Ray still starts its dashboard process then, loading only the
  usage-stats module (the heads run with `--disable-usage-stats`, so it has nothing to do), and `ray start` waits
  until that process has published its address before it starts the raylet: 0.7 CPU-s, and on the 2-core Xeon
  the docs measure on, a head up in 2.43 s instead of 3.29 (medians of 6 starts each, alternated). The head then
  has no dashboard address; `ray.init` and `ray start` treat that as a head without a dashboard.

Where a Ray release has no such probe or method the patch is skipped and Ray starts what it did before.
"""

from __future__ import annotations

import sys

from ray._private import node
from ray.scripts import scripts

#: The probe `ray start` asks; a non-None answer means "no client extras", so no client server.
PROBE = "get_ray_client_dependency_error"


def _no_api_server(self: node.Node, **kwargs: object) -> None:
    """Node.start_api_server for a head started with --include-dashboard=false: nothing to start."""


def main() -> int:
    if hasattr(scripts, PROBE):
        setattr(scripts, PROBE, lambda: "rlbus starts its Ray heads without a Ray Client server")
    if "--include-dashboard=false" in sys.argv[1:] and hasattr(node.Node, "start_api_server"):
        node.Node.start_api_server = _no_api_server
    return scripts.main()


if __name__ == "__main__":
    sys.exit(main())

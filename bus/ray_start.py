"""`ray start` without the Ray Client server: `python -m rlbus.bus.ray_start start --head ...` is `ray start ...`.

`ray start --head` runs a Ray Client server (the `ray://` proxy) whenever Ray's client extras are importable, and
has no switch to leave it out (a port of 0 is refused). rlbus's drivers join a head directly (`ensure_ray`), never
through `ray://`, and that server cost about 1 CPU-s of every head's start on 2 cores, where start-up is CPU-bound
(docs/benchmarks.md). So the heads and nodes rlbus starts (bus/ray_cluster.py) run Ray's own CLI with its probe for
the client extras answering that they are missing. Where a Ray release has no such probe the patch is skipped and
the server runs, as it did before.
"""

from __future__ import annotations

import sys

from ray.scripts import scripts

#: The probe `ray start` asks; a non-None answer means "no client extras", so no client server.
PROBE = "get_ray_client_dependency_error"


def main() -> int:
    if hasattr(scripts, PROBE):
        setattr(scripts, PROBE, lambda: "rlbus starts its Ray heads without a Ray Client server")
    return scripts.main()


if __name__ == "__main__":
    sys.exit(main())

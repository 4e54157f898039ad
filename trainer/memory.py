"""Peak resident memory of this process, per step: the trainer's `perf/peak_rss_gb`.

Linux keeps the process's high-water mark of resident memory (VmHWM in /proc/self/status) and resets it when "5" is
written to /proc/self/clear_refs, so each step can report its own peak, not the largest since start. Elsewhere (or
when /proc is not writable) the peak is getrusage's ru_maxrss, the largest since start.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_rss() -> bool:
    """Start a new peak from the current resident size; False when the platform cannot (the peak then stays)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """The largest resident size of this process since the last `reset_peak_rss` (or since start)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, kB on Linux

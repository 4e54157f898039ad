"""Bytes that crossed from one simulated machine to another, read from the kernel's TCP counters (`ss -tinp`).

The "machines" of a multi-node test are groups of processes on this one (a Ray node's process group, the roles
started beside it), and their connections run over loopback, where the source address of a connection says nothing
about who opened it (127.0.0.1 for most). So a connection is placed by the processes at its two ends: `snapshot`
maps each established TCP socket to its owner's process group and the bytes it has received, and `crossed` adds up,
between two snapshots, what sockets of the receiving groups received from sockets of the sending groups. A
connection that closed between the snapshots is not counted (Ray keeps its channels open for the run).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

_USER = re.compile(r"pid=(\d+)")
_RECEIVED = re.compile(r"\bbytes_received:(\d+)")


@dataclass(frozen=True)
class Socket:
    local: str  # "addr:port"
    peer: str
    pgid: int  # process group of its (first) owner; -1 when gone
    received: int


def _endpoint(text: str) -> str:
    """An IPv4 peer as an IPv6 socket sees it ("[::ffff:127.0.0.1]:4222") spelled as the IPv4 end sees it."""
    return re.sub(r"^\[::ffff:([0-9.]+)\]", r"\1", text)


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1


def snapshot() -> dict[tuple[str, str], Socket]:
    """Every established TCP socket of this machine, keyed by (local, peer) endpoints."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True, check=True).stdout
    sockets: dict[tuple[str, str], Socket] = {}
    head: list[str] | None = None
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):  # a socket's line: Recv-Q Send-Q local peer users:((...))
            head = line.split()
            continue
        if head is None or len(head) < 4:
            continue
        local, peer = _endpoint(head[2]), _endpoint(head[3])
        owner = _USER.search(" ".join(head[4:]))
        got = _RECEIVED.search(line)
        sockets[local, peer] = Socket(local, peer, _pgid(int(owner.group(1))) if owner else -1,
                                      int(got.group(1)) if got else 0)
        head = None
    return sockets


def crossed(before: dict[tuple[str, str], Socket], after: dict[tuple[str, str], Socket], *,
            receivers: set[int], senders: set[int]) -> int:
    """Bytes that sockets of the `receivers` process groups received, between the two snapshots, over connections
    whose other end belongs to the `senders` process groups."""
    owner = {s.local: s.pgid for s in after.values()}
    total = 0
    for key, s in after.items():
        if s.pgid in receivers and owner.get(s.peer) in senders:
            was = before.get(key)
            total += s.received - (was.received if was is not None else 0)
    return total

"""Which TCP sockets a set of processes listens on, read from /proc (Linux; no `ss`, no dependencies).

    from tests.support.listeners import process_tree, listening_sockets, is_loopback
    for sock in listening_sockets(process_tree(head.pid)):
        assert is_loopback(sock.address), sock

A socket is a process's when one of its /proc/<pid>/fd links reads `socket:[<inode>]`; its address and state are in
/proc/<pid>/net/tcp and tcp6 (the process's network namespace), found by that inode.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rlbus.bus.proc import descendants

_TCP_LISTEN = "0A"  # include/net/tcp_states.h: TCP_LISTEN = 10


@dataclass(frozen=True)
class Listener:
    pid: int
    name: str  # /proc/<pid>/comm (what `ps -o comm` shows: raylet, gcs_server, ray::IDLE, python ...)
    address: str  # "127.0.0.1", "::", "::ffff:127.0.0.1", ...
    port: int

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.name}[{self.pid}] {host}:{self.port}"


def process_tree(*roots: int) -> list[int]:
    """The given processes and all their living descendants (by parent, so a child that started a session or
    process group of its own -- Ray's workers do, and so do the roles `rlbus up` forks -- is still found)."""
    tree = {r for r in roots if Path(f"/proc/{r}").exists()}
    for root in list(tree):
        tree.update(descendants(root))
    return sorted(tree)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _decode(hex_addr: str) -> str:
    # /proc/net/tcp{,6} print each 32-bit word of the address in host byte order (little-endian here).
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(raw) == 4:
        return socket.inet_ntoa(words)
    ip = ipaddress.IPv6Address(words)
    return f"::ffff:{ip.ipv4_mapped}" if ip.ipv4_mapped is not None else str(ip)


def _listening_in_netns(pid: int) -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket in the network namespace of `pid`."""
    found: dict[int, tuple[str, int]] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != _TCP_LISTEN:
                continue
            addr, port = f[1].split(":")
            found[int(f[9])] = (_decode(addr), int(port, 16))
    return found


def listening_sockets(pids: Iterable[int]) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) held by one of `pids`."""
    out = []
    tables: dict[str, dict[int, tuple[str, int]]] = {}
    for pid in pids:
        inodes = _socket_inodes(pid)
        if not inodes:
            continue
        try:
            netns = os.readlink(f"/proc/{pid}/ns/net")
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        table = tables.get(netns)
        if table is None:
            table = tables[netns] = _listening_in_netns(pid)
        for inode in sorted(inodes & table.keys()):
            address, port = table[inode]
            out.append(Listener(pid, name, address, port))
    return out


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback address (::ffff:127.x.y.z)."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback

"""Process-group set-up for the FSDP2 trainer: under torchrun, spawned locally, or a single rank with no launcher.

    torchrun --nproc-per-node 2 -m rlbus.cli trainer CONFIG        # env:// (RANK, WORLD_SIZE, MASTER_ADDR/PORT)
    rlbus trainer CONFIG trainer.num_ranks=2                       # spawn_local(): a store on 127.0.0.1 only
    rlbus trainer CONFIG                                           # one rank, an in-process store, no network

gloo on CPU, NCCL on CUDA. World size 1 still gets a (one-member) process group so FSDP2 runs the same code path.

What listens where. torch's TCPStore server binds every interface ([::], dual-stack) whatever host name it is
given (torch 2.13, libuv and classic backends alike); only a socket it is handed (`master_listen_fd`) limits it.
So spawn_local serves the rendezvous store from the parent process, on a socket bound to 127.0.0.1, and the ranks
are its clients; it also sets GLOO_SOCKET_IFNAME=lo, since gloo otherwise binds its pair sockets to whatever the
machine's host name resolves to. Under torchrun the store is the elastic agent's, and it listens on [::]:PORT
whatever --master-addr / --rdzv-endpoint / --local-addr say: keep single-machine torchrun runs behind a firewall
(or in a network namespace), and set GLOO_SOCKET_IFNAME=lo (NCCL: NCCL_SOCKET_IFNAME=lo) for the ranks' sockets.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import socket
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.constants import default_pg_timeout

Device = Literal["cpu", "cuda"]

LOOPBACK = "127.0.0.1"
# Set in spawn_local's children: the rendezvous store is served by the parent (on loopback), not by rank 0.
_parent_store: tuple[str, int] | None = None


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _device_for(kind: Device, local_rank: int) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: Device = "cpu") -> DistInfo:
    """Join (or create) the default process group and return this rank's place in it. Idempotent."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _device_for(device, local_rank)
    backend = "nccl" if device == "cuda" else "gloo"
    if not dist.is_initialized():
        if _parent_store is not None:  # spawn_local: every rank is a client of the parent's loopback store
            host, port = _parent_store
            store = dist.TCPStore(host, port, is_master=False, timeout=default_pg_timeout)
            dist.init_process_group(
                backend,
                store=store,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                device_id=dev if device == "cuda" else None,
            )
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            if "MASTER_PORT" not in os.environ:
                raise ValueError("MASTER_PORT: must be set when RANK and WORLD_SIZE are (torchrun sets all three)")
            dist.init_process_group(
                backend,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                device_id=dev if device == "cuda" else None,
            )
        else:
            # No launcher: a one-member group over an in-process store, so nothing listens on a port.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=dev)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce(
    values: list[float], op: Literal["sum", "max"] = "sum", device: torch.device | None = None
) -> list[float]:
    """Element-wise reduction of a few floats across ranks (float64, one collective for the whole list)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    if device is None:  # NCCL only reduces CUDA tensors
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor(values, dtype=torch.float64, device=device or torch.device("cpu"))
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def _spawned_entry(
    local_rank: int, num_ranks: int, port: int, results: Any, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    global _parent_store
    _parent_store = (LOOPBACK, port)
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(num_ranks),
        MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port),  # for whoever reads them; init_distributed uses _parent_store
        GLOO_SOCKET_IFNAME="lo",  # gloo's pair sockets on loopback, not on the host name's address
    )  # fmt: skip
    out = fn(*args)
    # Plain pickle bytes: torch's queue reductions would pass tensors as shared-memory handles that die with
    # this process, before the parent reads them.
    results.put((local_rank, pickle.dumps(out)))


def spawn_local(num_ranks: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run `fn(*args)` on `num_ranks` fresh local processes wired as one process group; return their results by rank.

    Each child gets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR=127.0.0.1 / MASTER_PORT in its environment and
    calls `init_distributed` itself (inside `fn`), which joins the rendezvous store this process serves meanwhile on
    127.0.0.1 only (module docstring). `fn` must be importable (a module-level function) and its return value
    picklable. A child's exception is re-raised here (torch's ProcessRaisedException).
    """
    if num_ranks < 1:
        raise ValueError("num_ranks: must be >= 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = _loopback_store()
    try:
        procs = mp.start_processes(
            _spawned_entry, args=(num_ranks, store.port, results, fn, args), nprocs=num_ranks, join=False,
            start_method="spawn",
        )  # fmt: skip
        return _collect(procs, results, num_ranks)
    finally:
        del store  # its server stops with the last reference


def _loopback_store() -> dist.TCPStore:
    """A TCPStore server listening on 127.0.0.1 only (and on a port it holds from the start: no free-port race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(128)
        store = dist.TCPStore(
            LOOPBACK, sock.getsockname()[1], is_master=True, wait_for_workers=False,
            timeout=default_pg_timeout, master_listen_fd=sock.fileno(),
        )  # fmt: skip
    except BaseException:
        with contextlib.suppress(OSError):
            sock.close()
        raise
    sock.detach()  # the store owns (and closes) the descriptor now
    return store


def _collect(procs: Any, results: Any, num_ranks: int) -> list[Any]:
    collected: dict[int, Any] = {}
    # Drain while waiting: a child blocks on a full pipe until its result is read, so join() alone could hang.
    while True:
        done = procs.join(timeout=0.2)
        while True:
            try:
                r, out = results.get_nowait()
            except queue.Empty:
                break
            collected[r] = pickle.loads(out)
        if done:
            break
    while len(collected) < num_ranks:  # results flushed after the last join poll
        r, out = results.get(timeout=30)
        collected[r] = pickle.loads(out)
    return [collected[r] for r in range(num_ranks)]

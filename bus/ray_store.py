"""What the run's storage actors (TransferQueue shards, weight store) share: tensor packing, plan drivers, names.

Tensors travel as numpy arrays (zero-copy both ways); dtypes numpy lacks (bfloat16, ...) travel as a same-width
integer view and are viewed back. Arrays that come out of the object store are read-only: tensors made from them
(`unpack_tensor` inside `quiet_readonly()`) must be treated as read-only.

Every client operation is written once, as a plan: a generator that yields the Ray calls (ObjectRefs) it must wait
for and receives their results; its return value is the operation's result. `run_async` drives a plan on an event
loop (producers, the trainer's controller), `run_sync` with ray.get (trainer ranks), so the async methods and their
`*_sync` twins cannot drift apart. A plan may also yield a number: the driver sleeps that long (time.sleep or
asyncio.sleep) and sends None back; `retried` uses it to wait out an actor's restart.

    .venv/bin/python -m pytest -q tests/integration/test_transfer_queue.py
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import numpy as np
import ray
import torch

from rlbus.bus.ray_cluster import ensure_ray
from rlbus.schemas.config import RayConfig

log = logging.getLogger(__name__)

T = TypeVar("T")
# A plan yields the Ray calls (ObjectRefs) it must wait for and receives their results, or a pause in seconds; its
# return value is the operation's result.
Plan = Generator["list[ray.ObjectRef] | float", Any, T]
#: How long a call to a restarting actor (its node died; Ray restarts it elsewhere) is retried.
ACTOR_RESTART_WAIT_S = 60.0
Packed = tuple[str, np.ndarray]  # (torch dtype name, array); the array may be an integer view of that dtype

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_OK: dict[torch.dtype, bool] = {}


def _numpy_ok(dtype: torch.dtype) -> bool:
    ok = _NUMPY_OK.get(dtype)
    if ok is None:
        try:  # the only way to learn whether this torch build maps a dtype to numpy; asked once per dtype
            torch.empty(0, dtype=dtype).numpy()
            ok = True
        except TypeError:
            ok = False
        _NUMPY_OK[dtype] = ok
    return ok


def pack_tensor(t: torch.Tensor) -> Packed:
    """A CPU tensor as (dtype name, numpy array sharing its memory); GPU tensors are copied to CPU first."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if not _numpy_ok(t.dtype):
        t = t.view(_INT_OF_WIDTH[t.element_size()])
    return name, t.numpy()


def unpack_tensor(packed: Packed) -> torch.Tensor:
    """Inverse of pack_tensor, zero-copy. Call inside `quiet_readonly()` when the array may be read-only."""
    name, arr = packed
    t = torch.from_numpy(arr)
    dtype = getattr(torch, name)
    return t if t.dtype == dtype else t.view(dtype)


class quiet_readonly(warnings.catch_warnings):
    # Arrays from the object store are read-only; torch warns on each from_numpy of one. We hand them out as
    # documented read-only tensors, so the warning is noise here (and only here).
    def __enter__(self) -> None:
        super().__enter__()
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def run_sync(plan: Plan[T]) -> T:
    """Drive `plan` with ray.get. A failed call is thrown into the plan, at its `yield`, for it to handle."""
    try:
        step = next(plan)
        while True:
            if isinstance(step, (int, float)):
                time.sleep(step)
                step = plan.send(None)
                continue
            try:
                results = ray.get(step)
            except ray.exceptions.RayError as e:
                step = plan.throw(e)
            else:
                step = plan.send(results)
    except StopIteration as done:
        return done.value


async def run_async(plan: Plan[T]) -> T:
    """Drive `plan` on the event loop; failures are thrown into it as in run_sync."""
    try:
        step = next(plan)
        while True:
            if isinstance(step, (int, float)):
                await asyncio.sleep(step)
                step = plan.send(None)
                continue
            try:
                results = list(await asyncio.gather(*step))
            except ray.exceptions.RayError as e:
                step = plan.throw(e)
            else:
                step = plan.send(results)
    except StopIteration as done:
        return done.value


def retried(calls: Callable[[], list[ray.ObjectRef]], what: str, budget_s: float = ACTOR_RESTART_WAIT_S,
            revive: Callable[[], int] | None = None) -> Plan[list[Any]]:
    """A plan step that makes `calls()` again while an actor is restarting (ActorUnavailableError), with doubling
    pauses, for at most `budget_s`. With `revive`, an actor that died for good (its node is gone and Ray cannot
    restart it where it was placed) is made again by `revive()` (which returns how many it made), and the calls go
    to the new one. Only for calls that may run twice: a restarted actor starts empty, and an unavailable one may or
    may not have run the call."""
    deadline = time.monotonic() + budget_s
    pause = 0.2
    while True:
        try:
            return (yield calls())
        except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnschedulableError) as e:
            if revive is None or time.monotonic() > deadline or not revive():
                raise
            log.warning("%s: an actor died for good (%s); made it again, empty", what, type(e).__name__)
        except ray.exceptions.ActorUnavailableError as e:
            if time.monotonic() + pause > deadline:
                raise
            log.warning("%s: actor unavailable (%s); retrying in %.1fs", what, type(e).__name__, pause)
            yield pause
            pause = min(pause * 2, 1.0)  # cheap to ask; a longer pause only adds to the stall once it is back


def actor_name(run: str, what: str) -> str:
    """The name of one of the run's detached actors (`tq-<i>-of-<n>`, `weights`)."""
    return f"rlbus-{run}-{what}"


def teardown(run: str, cfg: RayConfig) -> list[str]:
    """Kill the run's named actors (TransferQueue shards of any count, weight store); returns their names."""
    ensure_ray(cfg)
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == cfg.namespace
        and (a["name"] in (actor_name(run, "weights"), actor_name(run, "deltas"))
             or a["name"].startswith(actor_name(run, "tq-")))
    ]
    for name in names:
        ray.kill(ray.get_actor(name, namespace=cfg.namespace), no_restart=True)
    return names

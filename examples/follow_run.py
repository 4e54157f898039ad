"""Follow a live rlbus run from the wire contract alone (docs/wire.md): nats-py and msgspec, no rlbus import.

    python examples/follow_run.py runs/quickstart/bus/creds/quickstart/observer.json
    python examples/follow_run.py CREDS --from-start --until-step 5

Prints one line per trained step, weight version, trajectory group and producer heartbeat. The observer's
credential file holds everything needed to connect: url, user, password, run and the inbox prefix its permissions
allow replies on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import msgspec
import nats
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

REWARD = 3  # SampleMeta is array-like: slot 3 is the reward (docs/wire.md, "SampleMeta")


def stream(run: str, name: str) -> str:
    return f"RLBUS_{run.replace('-', '_').upper()}_{name}"  # docs/wire.md, "Names of a run"


def line(msg: dict) -> str:
    kind = msg.get("kind")
    if kind == "step_completed":
        reward = msg["metrics"].get("reward/mean", float("nan"))
        return f"step {msg['step']} version {msg['version']} groups {len(msg['group_ids'])} reward {reward:.3f}"
    if kind == "weights_published":
        return f"weights v{msg['version']} step {msg['step']} {msg['num_bytes']} bytes {msg['checksum'][:12]}"
    if kind == "trajectory_group":
        rewards = [sample[REWARD] for sample in msg["samples"]]
        return f"group {msg['group_id']} from {msg['producer_id']} rewards {rewards}"
    if kind == "producer_heartbeat":
        return (f"heartbeat {msg['producer_id']} version {msg['version']} groups {msg['groups_done']} "
                f"({msg['groups_per_min']:.1f}/min) {msg['status']}")
    if kind in ("role_started", "role_stopped"):
        return f"{kind} {msg['role']} {msg['role_id']}"
    return f"{kind}"  # an event kind this client does not know: skip its fields, keep going


async def follow(args: argparse.Namespace, creds: dict) -> int:
    run, url = args.run or creds["run"], args.url or creds["url"]
    nc = await nats.connect(url, user=creds["user"], password=creds["password"], inbox_prefix=creds["inbox_prefix"])
    js = nc.jetstream()
    policy = DeliverPolicy.ALL if args.from_start else DeliverPolicy.NEW
    done = asyncio.Event()

    async def on_message(m) -> None:
        try:
            msg = msgspec.msgpack.decode(m.data)
        except msgspec.DecodeError:
            return  # not ours to judge; rlbus dead-letters what it cannot read
        if not isinstance(msg, dict) or msg.get("schema_version") != 1:
            return  # a contract version this client was not written for
        print(line(msg), flush=True)
        if msg.get("kind") == "step_completed" and args.until_step and msg["step"] >= args.until_step:
            done.set()

    try:
        async with asyncio.timeout(args.timeout or None):
            # Ordered consumers: ephemeral, in order, nothing to ack -- what an observer may create on the run's
            # streams. The trainer (or `rlbus up`) creates the streams: a client started first waits for them.
            for subject, name in ((f"rlbus.{run}.events.>", "EVENTS"), (f"rlbus.{run}.weights", "WEIGHTS"),
                                  (f"rlbus.{run}.traj", "TRAJ")):
                while True:
                    try:
                        await js.subscribe(subject, stream=stream(run, name), cb=on_message, ordered_consumer=True,
                                           deliver_policy=policy)
                        break
                    except NotFoundError:
                        await asyncio.sleep(0.5)
            await done.wait()
        return 0
    except TimeoutError:
        print(f"no step {args.until_step} within {args.timeout}s", file=sys.stderr)
        return 1
    finally:
        await nc.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("creds", help="the run's observer credential file (<store>/creds/<run>/observer.json)")
    p.add_argument("--run", default="", help="run name (default: the file's `run`)")
    p.add_argument("--url", default="", help="NATS URL (default: the file's `url`)")
    p.add_argument("--from-start", action="store_true", help="replay what the streams hold before following")
    p.add_argument("--until-step", type=int, default=0, help="exit 0 once this step is trained (0: follow forever)")
    p.add_argument("--timeout", type=float, default=0.0, help="exit 1 after this many seconds (0: never)")
    try:
        args = p.parse_args()
        return asyncio.run(follow(args, json.loads(Path(args.creds).read_text())))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""Per-role NATS credentials: who may publish and subscribe to what, for one run.

Every run gets four users on the bus, each allowed what its role does and nothing else (invariant 6,
docs/security.md):

| role | may | may not |
|---|---|---|
| admin | everything (stream set-up by `rlbus up`; an operator's tool) | - |
| trainer | publish prompts, weights, events; consume `traj`; create and update the run's streams, bucket, consumers | delete a stream; touch another run |
| producer | pull prompts (ack / nak / in progress), publish traj, heartbeats and its own events; read weights and the KV bucket; write its unacked list there (`unacked.producer.<id>`) | publish prompts or weights, write any other KV key, manage or delete streams |
| observer | read the run's streams and bucket (status, `events --follow`) | publish anything on the run's subjects, manage streams |

Reading a JetStream stream still means sending requests to the JetStream API (`$JS.API.CONSUMER.CREATE...` for an
ordered consumer, `$JS.API.DIRECT.GET...` for a KV entry); those requests are allowed for the run's own streams
only. Replies come back on a per-role inbox prefix (`_INBOX.<run>.<role>.>`), so one role cannot read what the
server sends another.

The server stores only bcrypt hashes of the passwords (`nats-server` checks bcrypt natively); the passwords live in
one 0600 file per role, in a 0700 directory:

    <store>/creds/<run>/{admin,trainer,producer,observer}.json       {"user", "password", "role", "run", "url",
                                                                     "inbox_prefix"}

    .venv/bin/python -m pytest -q tests/integration/test_bus_auth.py
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Literal

import bcrypt

from rlbus.bus.streams import PRODUCERS_KEY
from rlbus.schemas.errors import BusError
from rlbus.schemas.subjects import Subjects, check_run_name

Role = Literal["admin", "trainer", "producer", "observer"]
ROLES: tuple[Role, ...] = ("admin", "trainer", "producer", "observer")
CREDS_DIR = "creds"
#: bcrypt cost of the stored hashes: checked once per connection, so a few milliseconds matter little.
BCRYPT_ROUNDS = 10


def user_name(run: str, role: Role) -> str:
    return f"{role}-{run}"


def inbox_prefix(run: str, role: Role) -> str:
    """Where this role's replies and deliveries arrive (nats-py's `inbox_prefix`)."""
    return f"_INBOX.{run}.{role}"


def _js(stream: str, *ops: str) -> list[str]:
    """JetStream API subjects of `ops` on one stream (`op` may hold dots, e.g. "MSG.GET")."""
    return [f"$JS.API.{op}.{stream}" for op in ops]


def _consumer_api(stream: str, *ops: str) -> list[str]:
    # Consumer subjects end in the consumer's name (and, for a filtered create, its filter subject).
    return [f"$JS.API.CONSUMER.{op}.{stream}{tail}" for op in ops for tail in ("", ".>")]


def _reader(s: Subjects, streams: list[str], kv_stream: str) -> list[str]:
    """What reading a run's streams and KV bucket publishes: ordered consumers, stream info, direct gets, flow
    control replies."""
    out = ["$JS.API.INFO"]
    for stream in [*streams, kv_stream]:
        out += _js(stream, "STREAM.INFO", "STREAM.MSG.GET")
        out += [f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>"]
        out += _consumer_api(stream, "CREATE", "INFO", "DELETE")
        out.append(f"$JS.FC.{stream}.>")
    return out


def permissions(run: str, role: Role) -> dict[str, dict[str, list[str]]]:
    """The nats-server `permissions` block of `role` in run `run`."""
    check_run_name(run)
    s = Subjects.for_run(run)
    kv_stream = f"KV_{s.weights_bucket}"
    kv_subjects = f"$KV.{s.weights_bucket}.>"
    streams = [s.prompts_stream, s.traj_stream, s.weights_stream, s.events_stream]
    inbox = f"{inbox_prefix(run, role)}.>"
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if role == "observer":
        return {"publish": {"allow": _reader(s, streams, kv_stream)}, "subscribe": {"allow": [inbox]}}
    if role == "producer":
        # events.eval: the evaluator role (producers/evaluator.py) runs with the producer's credential.
        own_events = [s.event("heartbeat.*"), s.event("lifecycle"), s.event("error"), s.event("eval"),
                      s.dead_letter]
        # Its unacked list in the KV bucket (bus/handover.py), for a successor under its id on another machine. Any
        # producer may write any producer's key: a forged list makes a successor nak deliveries of the prompts
        # consumer, which a producer's credential may do directly anyway ($JS.ACK below).
        pub = [s.traj, *own_events, *_reader(s, [s.weights_stream], kv_stream)]
        pub.append(f"$KV.{s.weights_bucket}.{PRODUCERS_KEY}.>")
        pub += _js(s.prompts_stream, "STREAM.INFO") + _js(s.traj_stream, "STREAM.INFO")
        pub += _js(s.events_stream, "STREAM.INFO")
        pub += [f"$JS.API.CONSUMER.MSG.NEXT.{s.prompts_stream}.{s.prompts_consumer}",
                f"$JS.API.CONSUMER.INFO.{s.prompts_stream}.{s.prompts_consumer}",
                f"$JS.ACK.{s.prompts_stream}.{s.prompts_consumer}.>"]
        return {"publish": {"allow": pub}, "subscribe": {"allow": [inbox]}}
    if role == "trainer":
        pub = [s.prompts, s.weights, f"{s.prefix}.events.>", kv_subjects, *_reader(s, streams, kv_stream)]
        for stream in [*streams, kv_stream]:
            pub += _js(stream, "STREAM.CREATE", "STREAM.UPDATE")
            pub += _consumer_api(stream, "DURABLE.CREATE")
        pub += _js(s.prompts_stream, "STREAM.MSG.DELETE")  # moving a max_deliver'd prompt to the dead letters
        pub += [f"$JS.API.CONSUMER.MSG.NEXT.{s.traj_stream}.{s.traj_consumer}",
                f"$JS.ACK.{s.traj_stream}.{s.traj_consumer}.>"]
        # The feeder's queue of max-deliveries advisories (the server itself publishes into it).
        adv = s.advisories_stream
        pub += _js(adv, "STREAM.CREATE", "STREAM.UPDATE", "STREAM.INFO")
        pub += _consumer_api(adv, "CREATE", "DURABLE.CREATE", "INFO")
        pub += [f"$JS.API.CONSUMER.MSG.NEXT.{adv}.{s.advisories_consumer}",
                f"$JS.ACK.{adv}.{s.advisories_consumer}.>"]
        return {"publish": {"allow": pub}, "subscribe": {"allow": [inbox]}}
    raise BusError(f"unknown bus role {role!r}; expected one of {list(ROLES)}")


def load_creds(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read a credentials file: {"user", "password"} or {"token"}, plus "url" and "inbox_prefix" when the embedded
    server wrote it (bus/auth.py)."""
    p = Path(path)
    try:
        creds = json.loads(p.read_text())
    except FileNotFoundError as e:
        raise BusError(f"credentials file {p} does not exist (written by `rlbus bus up`)") from e
    except json.JSONDecodeError as e:
        raise BusError(f"credentials file {p} is not valid JSON: {e}") from e
    if not isinstance(creds, dict) or not (creds.get("token") or (creds.get("user") and creds.get("password"))):
        raise BusError(f"credentials file {p} holds neither a token nor a user and password")
    return {str(k): str(v) for k, v in creds.items()}


def creds_dir(store_dir: str | os.PathLike[str], run: str) -> Path:
    return Path(store_dir) / CREDS_DIR / run


def write_private(path: Path, text: str) -> None:
    # Created 0600 from the start (no window in which the secret is readable by others), then enforced in case the
    # file already existed with wider permissions.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) and make it 0700."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


class RunCredentials:
    """The four users of one run: passwords kept in their role files, bcrypt hashes handed to the server."""

    run: str
    dir: Path
    passwords: dict[Role, str]
    hashes: dict[Role, str]

    def __init__(self, store_dir: str | os.PathLike[str], run: str):
        self.run = check_run_name(run)
        self.dir = creds_dir(store_dir, run)
        self.passwords, self.hashes = {}, {}
        for role in ROLES:
            existing = self._read(role)
            # A restarted server keeps the credentials its clients already hold.
            password = existing.get("password") or secrets.token_urlsafe(24)
            self.passwords[role] = password
            self.hashes[role] = bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_ROUNDS)).decode()

    def _read(self, role: Role) -> dict[str, str]:
        path = self.file(role)
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            return {}
        return data if isinstance(data, dict) and data.get("user") == user_name(self.run, role) else {}

    def file(self, role: Role) -> Path:
        return self.file_of(self.dir.parent.parent, self.run, role)

    @staticmethod
    def file_of(store_dir: str | os.PathLike[str], run: str, role: Role) -> Path:
        return creds_dir(store_dir, run) / f"{role}.json"

    def users(self) -> list[dict]:
        """The server's `authorization.users` entries of this run."""
        return [{"user": user_name(self.run, r), "password": self.hashes[r], "permissions": permissions(self.run, r)}
                for r in ROLES]

    def url(self) -> str:
        """The URL(s) the role files name now ("" before the first write)."""
        return self._read("admin").get("url", "")

    def write(self, url: str) -> None:
        """Write each role's 0600 file (the URL included, so `bus.creds_file=...` alone reaches the server)."""
        private_dir(self.dir.parent)
        private_dir(self.dir)
        for role in ROLES:
            write_private(self.file(role), json.dumps({
                "user": user_name(self.run, role), "password": self.passwords[role], "role": role, "run": self.run,
                "url": url, "inbox_prefix": inbox_prefix(self.run, role)}, indent=2) + "\n")

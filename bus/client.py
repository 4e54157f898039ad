"""The asyncio NATS JetStream client every role uses: typed publish, typed pull consumption, watch, KV.

    async with await Bus.connect(cfg.bus, run="quickstart", name="producer-0") as bus:
        await bus.ensure_streams()
        await bus.publish(bus.subjects.traj, group, msg_id=group.group_id)
        async for d in bus.pull(bus.subjects.traj, bus.subjects.traj_consumer, TrajectoryGroup, batch=16):
            ...; await d.ack()

Messages are msgspec-msgpack wire structs (rlbus.schemas.wire). A message that cannot be decoded, or carries an unknown
schema version, is terminated and republished as a `DeadLetter` on `events.dead_letter`; consumers keep going.
The consuming methods (fetch, pull, watch, snapshot, exhausted) are inherited from `Consuming` (bus/consuming.py).
Benchmark: `python bench/bus.py` (docs/benchmarks.md, "Bus").
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from types import TracebackType
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck, StreamConfig
from nats.js.kv import KeyValue

from rlbus.bus.auth import load_creds
from rlbus.bus.consuming import Consuming
from rlbus.bus.delivery import ACK_TIMEOUT_S, MSG_ID_HEADER, Delivery, dead_letter_of
from rlbus.bus.retry import abandon_requests, is_transient, retrying
from rlbus.bus.streams import consumer_configs, kv_config, stream_configs
from rlbus.schemas.config import BusConfig
from rlbus.schemas.errors import BusError
from rlbus.schemas.subjects import Subjects
from rlbus.schemas.wire import EVENT_SUBJECT_KIND, TypedDecoder, encode

__all__ = ["Bus", "Delivery", "PubAck"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What a stopping role's remaining calls may spend retrying, all of them together (`Bus.stopping`).
STOP_RETRY_S = 10.0
#: How long one JetStream publish waits for its ack; a publish is retried for `bus.retry_s` (bus/retry.py).
PUBLISH_TIMEOUT_S = 5.0
#: nats-server error code: "stream name already in use with a different configuration".
_STREAM_NAME_IN_USE = 10058


#: The subject of a publish the server refused (nats-py hands the server's -ERR to the error callback as
#: "nats: permissions violation for publish to \"<subject>\"").
_REFUSED_PUBLISH = re.compile(r'permissions violation for publish to "([^"]+)"', re.IGNORECASE)


def _is_auth_error(e: Exception) -> bool:
    # nats-py reports a refused CONNECT as a plain Error carrying the server's "-ERR 'Authorization Violation'".
    return isinstance(e, nats.errors.AuthorizationError) or "authorization violation" in str(e).lower()


def _ssl_context(cfg: BusConfig) -> ssl.SSLContext | None:
    if not (cfg.tls_ca or cfg.tls_cert or cfg.tls_key):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.tls_ca or None)
    if cfg.tls_cert:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
    return ctx


def _auth(cfg: BusConfig) -> dict[str, str]:
    """nats-py connect arguments for the configured credentials (a role file also names the role's inbox prefix:
    its permissions allow replies only there, bus/auth.py)."""
    if cfg.token:
        return {"token": cfg.token}
    if cfg.user:
        return {"user": cfg.user, "password": cfg.password}
    if cfg.creds_file:
        creds = load_creds(cfg.creds_file)
        out = {"token": creds["token"]} if creds.get("token") else {"user": creds["user"],
                                                                     "password": creds["password"]}
        if creds.get("inbox_prefix"):
            out["inbox_prefix"] = creds["inbox_prefix"]
        return out
    return {}


class Bus(Consuming):
    """A connection to the run's NATS JetStream: owns the client, the JetStream context and the KV handle."""

    cfg: BusConfig
    run: str
    name: str
    subjects: Subjects
    nc: NATS
    js: JetStreamContext
    _kv: KeyValue | None
    _streams: dict[str, str]  # subject -> stream name
    _fetch_subs: dict[tuple[str, str], JetStreamContext.PullSubscription]  # (stream, durable) -> fetch()'s inbox
    _fetch_failing_since: dict[str, float]  # durable -> loop time its fetches began to fail transiently

    def __init__(self, cfg: BusConfig, run: str, name: str, nc: NATS, refused: dict[str, str] | None = None):
        self.cfg = cfg
        # subject -> the server's words, for each publish it refused since (filled by the connection's error callback)
        self._refused = {} if refused is None else refused
        self.run = run
        self.name = name
        self.subjects = Subjects.for_run(run)
        self.nc = nc
        self.js = nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
        self._kv = None
        self._fetch_subs = {}
        self._fetch_failing_since = {}
        self._aside: set[asyncio.Task] = set()  # dead letters a watch publishes beside its reading
        self._stop_budget: float | None = None  # set by stopping()
        self._stop_deadline: float | None = None  # loop time after which a stopping role's calls stop retrying
        s = self.subjects
        self._streams = {
            s.prompts: s.prompts_stream,
            s.traj: s.traj_stream,
            s.weights: s.weights_stream,
            s.events: s.events_stream,
        }

    # -- connection --------------------------------------------------------------------------------------------------

    @classmethod
    async def connect(cls, cfg: BusConfig, run: str, name: str = "") -> "Bus":
        """Connect (retrying within cfg.connect_timeout_s), then reconnect forever with doubling backoff."""
        url = cfg.url
        if not url and cfg.creds_file:
            # The embedded server writes its URL into the creds file too; `bus.creds_file=...` alone is enough.
            url = load_creds(cfg.creds_file).get("url", "")
        if not url:
            raise BusError("bus.url is empty: start a server with `rlbus bus up` and pass bus.url=... bus.creds_file=...")
        if url != cfg.url:
            cfg = msgspec.structs.replace(cfg, url=url)
        servers = [u.strip() for u in url.split(",") if u.strip()]
        connected = False
        refused: dict[str, str] = {}

        async def on_error(e: Exception) -> None:
            # While first connecting, a refused login will not get better by retrying: fail now, with the URL.
            if not connected and _is_auth_error(e):
                raise BusError(f"NATS at {cfg.url} refused the credentials of {name or 'client'}: {e}") from e
            if m := _REFUSED_PUBLISH.search(str(e)):
                refused[m[1]] = str(e)
            log.warning("bus %s (%s): %s: %s", cfg.url, name, type(e).__name__, e)

        async def on_disconnect() -> None:
            if connected and not nc.is_closed:  # closed = our own close(), not an outage
                lost = abandon_requests(nc)
                log.warning("bus %s (%s): disconnected; reconnecting (%d request(s) in flight asked again)",
                            cfg.url, name, lost)

        async def on_reconnect() -> None:
            log.info("bus %s (%s): reconnected", cfg.url, name)

        def backoff(pool: list[Any], info: dict[str, Any]) -> tuple[Any, float]:
            # nats-py waits a fixed reconnect_time_wait; this doubles it per failed attempt up to the maximum, so a
            # long outage does not hammer the server, and retries forever (max_reconnect_attempts=-1).
            s = min(pool, key=lambda srv: srv.reconnects)
            return s, min(cfg.reconnect_wait_s * 2 ** min(s.reconnects, 30), cfg.max_reconnect_wait_s)

        nc = NATS()
        try:
            await asyncio.wait_for(
                nc.connect(
                    servers=servers,
                    name=name or None,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    connect_timeout=cfg.connect_timeout_s,  # type: ignore[arg-type]  # nats-py takes floats
                    reconnect_time_wait=cfg.reconnect_wait_s,  # type: ignore[arg-type]
                    max_reconnect_attempts=-1,
                    reconnect_to_server_handler=backoff,
                    tls=_ssl_context(cfg),
                    **_auth(cfg),  # type: ignore[arg-type]
                ),
                timeout=cfg.connect_timeout_s,
            )
        except (asyncio.TimeoutError, OSError, nats.errors.Error) as e:
            await nc.close()
            raise BusError(f"cannot connect to NATS at {cfg.url} within {cfg.connect_timeout_s}s: {e!r}") from e
        except BusError:
            await nc.close()
            raise
        connected = True
        return cls(cfg, run, name, nc, refused)

    async def close(self, timeout: float = 5.0) -> None:
        """Drain (flush publishes, let subscriptions finish) for at most `timeout` s, then close."""
        if self.nc.is_closed:
            return
        # fetch()'s inboxes have no reader left: drop them rather than wait for drain (their unacked messages are
        # redelivered after ack_wait, as for any consumer that goes away).
        for sub in self._fetch_subs.values():
            await sub.unsubscribe()
        self._fetch_subs.clear()
        try:
            await asyncio.wait_for(self.nc.drain(), timeout)
        except asyncio.TimeoutError:
            log.warning("bus %s (%s): drain did not finish within %.1fs; closing", self.cfg.url, self.name, timeout)
        except nats.errors.ConnectionReconnectingError:
            pass  # no server to drain to (it is gone, or between two of a cluster): nothing can be flushed
        if not self.nc.is_connected:
            # Requests made while reconnecting wait in the client's reconnect buffer; nats-py's close() would write
            # them into the dead transport and raise ConnectionResetError (nats-py 2.16 Client._close). They can
            # reach no server now: drop them (what they would have acknowledged is redelivered, as for any exit).
            self.nc._pending.clear()
            self.nc._pending_data_size = 0
        await self.nc.close()

    async def __aenter__(self) -> "Bus":
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # -- streams -----------------------------------------------------------------------------------------------------

    async def ensure_streams(self, traj_max_ack_pending: int | None = None) -> None:
        """Create or update the run's streams, KV bucket and durable consumers. Idempotent and safe to race.

        `traj_max_ack_pending` (RunConfig.traj_max_ack_pending) bounds the groups the trainer may hold unacked; left
        at the server's default (1000), a trainer holding a few checkpoints' worth would stop getting groups.
        """
        for config in stream_configs(self.subjects, self.cfg):
            await self._ensure_stream(config)
        kv = kv_config(self.subjects, self.cfg)
        self._kv = await self._retry(f"create KV bucket {kv.bucket}", lambda: self.js.create_key_value(kv))
        # `name` + `durable_name` uses the create-or-update API: a changed ack_wait is applied, not refused.
        for stream, config in consumer_configs(self.subjects, self.cfg, traj_max_ack_pending):
            await self._retry(f"create consumer {config.durable_name} of {stream}",
                              lambda: self.js.add_consumer(stream, config))  # noqa: B023 (awaited at once)

    def stopping(self, budget_s: float = STOP_RETRY_S) -> None:
        """The role is stopping: its calls from now on retry for `budget_s` seconds in all, not `bus.retry_s` each.

        A role stopped while its server is gone for good (its launcher killed, with the embedded server) would
        otherwise spend `bus.retry_s` on every ack, nak and event of its shutdown: minutes in all. The budget's
        clock starts at the first call that fails after this, so a shutdown on a healthy bus is not hurried. Past
        it a call is still made once while the connection is up, and fails at once while it is not: what it would
        have acknowledged is redelivered after ack_wait, as for any role that dies.
        """
        self._stop_budget = budget_s

    def _stop_clock(self, started: float) -> None:
        if self._stop_deadline is None:  # from the start of the first call that failed
            self._stop_deadline = started + (self._stop_budget or 0.0)

    async def _retry(self, what: str, call: Any, describe: Any = None) -> Any:
        """`call()` retried through transient JetStream errors for `bus.retry_s` (bus/retry.py)."""
        if self._stop_budget is None:
            return await retrying(f"bus {self.name}: {what}", call, budget_s=self.cfg.retry_s, describe=describe)
        budget = min(self.cfg.retry_s, self._stop_budget)
        started = asyncio.get_running_loop().time()
        if self._stop_deadline is not None:
            budget = min(budget, max(0.0, self._stop_deadline - started))
            if budget == 0.0 and not self.nc.is_connected:
                raise BusError(f"bus {self.name}: {what}: not connected to {self.cfg.url} and the role is stopping "
                               "(its retries are spent)")
        return await retrying(f"bus {self.name}: {what}", call, budget_s=budget, describe=describe,
                              on_transient=lambda: self._stop_clock(started))

    async def await_streams(self, timeout: float = 120.0) -> None:
        """Wait until the run's streams, KV bucket and the producers' consumer exist (roles that may not create them:
        producers, observers). Whoever holds the trainer's or admin's credential creates them (`ensure_streams`)."""
        s = self.subjects
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        missing, announced = "?", ""
        while True:
            try:
                for stream in (s.prompts_stream, s.traj_stream, s.weights_stream, s.events_stream,
                               f"KV_{s.weights_bucket}"):  # (the advisories stream is the trainer's alone)
                    missing = f"stream {stream}"
                    await self.js.stream_info(stream)
                missing = f"consumer {s.prompts_consumer} of {s.prompts_stream}"
                await self.js.consumer_info(s.prompts_stream, s.prompts_consumer)
                return
            except Exception as e:
                if not (isinstance(e, nats.js.errors.NotFoundError) or is_transient(e)):
                    raise
                if loop.time() > deadline:
                    raise BusError(f"{missing} of run {self.run!r} does not exist on {self.cfg.url} after {timeout:.0f}s: "
                                   "the trainer (or `rlbus up`) creates the run's streams") from None
                if missing != announced:
                    log.info("bus %s: waiting for %s (created by the trainer)", self.name, missing)
                    announced = missing
                await asyncio.sleep(0.5)

    async def _ensure_stream(self, config: StreamConfig) -> None:
        try:
            await self._retry(f"create stream {config.name}", lambda: self.js.add_stream(config))
        except nats.js.errors.BadRequestError as e:
            if e.err_code != _STREAM_NAME_IN_USE:
                raise BusError(f"cannot create stream {config.name} on {self.cfg.url}: {e}") from e
            await self._retry(f"update stream {config.name}", lambda: self.js.update_stream(config))

    def stream_of(self, subject: str) -> str:
        """The stream that stores `subject` (events.<kind> belongs to the events stream)."""
        if subject in self._streams:
            return self._streams[subject]
        if subject.startswith(self.subjects.prefix + ".events."):
            return self.subjects.events_stream
        raise BusError(f"subject {subject!r} belongs to no stream of run {self.run!r}")

    # -- publishing --------------------------------------------------------------------------------------------------

    async def publish(self, subject: str, msg: Any, msg_id: str | None = None) -> PubAck:
        """Publish a wire struct and wait for JetStream to store it. `PubAck.duplicate` is True if an earlier publish
        of `msg_id` is on the bus, None if the publish was retried and the server dropped a copy that may have been
        this call's own first attempt (stored, its ack lost), False otherwise."""
        return await self.publish_raw(subject, encode(msg), msg_id)

    async def publish_raw(self, subject: str, payload: bytes, msg_id: str | None = None) -> PubAck:
        """Publish already-encoded bytes (dead letters, tools, benchmarks) with the same retry and ack rules."""
        headers = {MSG_ID_HEADER: msg_id} if msg_id else None
        if len(payload) > self.nc.max_payload:
            raise BusError(f"a {len(payload)}-byte message on {subject!r} exceeds the server's max_payload "
                           f"({self.nc.max_payload} bytes)")

        def describe(e: BaseException) -> str:
            if isinstance(e, nats.js.errors.NoStreamResponseError):
                return f"no stream stores {subject!r} on {self.cfg.url} (ensure_streams not run, or no stream leader)"
            return f"not acknowledged by JetStream at {self.cfg.url}: {type(e).__name__}: {e}"

        # A lost ack, a reconnect or a leader election: publish again. With a msg_id the server drops the copy if the
        # first one was stored; without one a retry may store the message twice (at-least-once). A publish the server
        # refused for lack of permission gets no reply either: it times out like a lost ack, but by then the error
        # callback has the refusal, and asking again would not help.
        attempts = 0
        self._refused.pop(subject, None)

        def attempt() -> Any:
            nonlocal attempts
            if subject in self._refused:
                raise BusError(f"bus {self.name}: publish on {subject!r}: the server refused it "
                               f"({self._refused.pop(subject)}): this credential may not publish there")
            attempts += 1
            return self.js.publish(subject, payload, timeout=PUBLISH_TIMEOUT_S, headers=headers)

        try:
            ack = await self._retry(f"publish on {subject!r}", attempt, describe)
        except nats.js.errors.APIError as e:
            raise BusError(f"JetStream refused a publish on {subject!r}: {e}") from e
        if ack.duplicate and attempts > 1:
            # The copy the server kept may be this call's own first attempt (stored, its ack lost in an outage), not
            # an earlier publish of the id: whether another publisher holds it is unknown, and None says so.
            log.info("bus %s: publish on %r took %d attempts and the last was a duplicate (of an attempt of its own, "
                     "or of an earlier publish of %r)", self.name, subject, attempts, msg_id)
            ack.duplicate = None
        return ack

    async def publish_event(self, event: Any) -> PubAck:
        """Publish an Event on `events.<kind>`."""
        kind = EVENT_SUBJECT_KIND.get(type(event))
        if kind is None:
            raise BusError(f"{type(event).__name__} is not an event type (see rlbus.schemas.wire.EVENT_SUBJECT_KIND)")
        return await self.publish(self.subjects.event(kind), event)

    # -- settling deliveries (the Settler of bus/delivery.py) -------------------------------------------------------

    @property
    def epoch(self) -> int:
        """How many times the connection was re-established: a delivery fetched at an earlier epoch may be unknown to
        the server it is settled on (Settler)."""
        return int(self.nc.stats["reconnects"])

    async def dead_letter(self, msg: Msg, reason: str, consumer: str, epoch: int) -> bool:
        """Publish the DeadLetter of a delivered message, then terminate it (`settle`'s outcome)."""
        letter = dead_letter_of(msg, reason, consumer=consumer)
        # Publish first: if that fails, the message is still unacked and comes back, rather than vanishing.
        await self.publish(self.subjects.dead_letter, letter)
        termed = await self.settle(msg, b"+TERM", consumer, epoch)
        log.warning("bus %s: dead-lettered %s seq %d: %s", self.name, msg.subject, letter.stream_seq, reason)
        return termed

    async def settle(self, msg: Msg, payload: bytes, consumer: str, epoch: int) -> bool:
        """Ack / nak / term a delivery (`payload`) and wait for JetStream to confirm it: True. False when the server
        no longer knows the delivery, found in about a second: the message will be delivered again.

        Sent as a request, JetStream answers once it applied the settle (like ack_sync), so a caller that goes on to
        count pending messages, or exits, sees the effect; retried through a failover (a settle applies once,
        whoever leads the consumer). But a nats-server SIGKILLed within milliseconds of a delivery restarts without
        it (its consumer state reaches the store a moment later), and then answers no +ACK or +TERM of it at all
        (nats-server consumer.go `processAckMsg`: an ack past the consumer's delivered pointer is dropped
        unanswered), while it delivers the message again as new. Asking again cannot help until it has re-delivered
        that message, so once the connection was re-established since the delivery (`epoch`), or an attempt got no
        answer, the server is asked first how far its consumer delivered: a delivery past that is unknown to it,
        and the settle stops there (a -NAK is then moot, a +ACK or +TERM left to that redelivery).
        """
        meta = msg.metadata
        seq, verb = meta.sequence.stream, payload.split()[0].decode()
        what = f"{verb} of {msg.subject} seq {seq} ({consumer})"
        ask_first = epoch != self.epoch
        unknown = False

        async def attempt() -> Any:
            nonlocal ask_first, unknown
            if ask_first:
                info = await self.js.consumer_info(meta.stream, meta.consumer)
                if seq > int(info.delivered.stream_seq or 0):
                    unknown = True
                    return None
            ask_first = True  # an attempt that fails (no answer, a dropped connection) may have met a restarted server
            return await self.nc.request(msg.reply, payload, timeout=ACK_TIMEOUT_S)

        await self._retry(what, attempt)
        if unknown:
            log.warning("bus %s: %s: the server no longer knows this delivery (a restart, or a new consumer leader, "
                        "lost it) and delivers the message again; not settled", self.name, what)
            return False
        return True

    # -- KV and status -----------------------------------------------------------------------------------------------

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            try:
                self._kv = await self._retry(f"KV bucket {self.subjects.weights_bucket}",
                                             lambda: self.js.key_value(self.subjects.weights_bucket))
            except nats.js.errors.BucketNotFoundError as e:
                raise BusError(f"KV bucket {self.subjects.weights_bucket} does not exist (ensure_streams not run?)") from e
        return self._kv

    async def kv_put(self, key: str, msg: Any) -> int:
        """Store a wire struct under `key` in the weights bucket; returns the revision."""
        bucket, value = await self._bucket(), encode(msg)
        return await self._retry(f"KV put {key}", lambda: bucket.put(key, value))

    async def kv_get(self, key: str, typ: type[T] | Any) -> T | None:
        """The struct stored under `key` in the weights bucket, or None if there is none."""
        try:
            bucket = await self._bucket()
            entry = await self._retry(f"KV get {key}", lambda: bucket.get(key))
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        return TypedDecoder(typ).decode(entry.value)

    async def consumer_pending(self, stream: str, durable: str) -> tuple[int, int]:
        """(num_pending, num_ack_pending) of a durable consumer: not yet delivered, delivered but not acked."""
        info = await self._retry(f"consumer info {stream}/{durable}", lambda: self.js.consumer_info(stream, durable))
        return int(info.num_pending or 0), int(info.num_ack_pending or 0)

    async def stream_last_seq(self, stream: str) -> int:
        """Sequence of the last message `stream` holds (0 if it never held one)."""
        try:
            info = await self._retry(f"stream info {stream}", lambda: self.js.stream_info(stream))
        except nats.js.errors.Error as e:
            raise BusError(f"stream info of {stream} on {self.cfg.url}: {e}") from e
        return int(info.state.last_seq)

    async def stream_msgs(self, stream: str) -> int:
        """Messages currently stored in `stream`."""
        info = await self._retry(f"stream info {stream}", lambda: self.js.stream_info(stream))
        return int(info.state.messages)

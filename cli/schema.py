"""`rlbus schema`: the wire contract as data, generated from the code that speaks it.

    rlbus schema                       # JSON Schema of every wire type (msgspec generates it) on stdout
    rlbus schema --out DIR             # the same into DIR/wire.schema.json
    rlbus schema --docs docs/wire.md   # the reference page: subjects, streams, types, fields, tags, evolution
    rlbus schema --check docs/wire.md  # exit 1 if the page is not what the code generates now

Everything comes from the code: the wire types are every msgspec Struct of `rlbus.schemas.wire` (a type added there
appears here without touching this file), subjects and JetStream objects from `Subjects.for_run` and the configs
`Bus.ensure_streams` applies (`bus/client.py`), the credential file's keys from what `bus/auth.py` writes, field
comments from the source lines that declare them. `tests/unit/test_wire_docs.py` regenerates the page and compares.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import sys
import tempfile
import textwrap
import tokenize
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from rlbus.bus.auth import ROLES, RunCredentials, load_creds
from rlbus.bus.handover import PRODUCERS_KEY, TRAINER_KEY
from rlbus.bus.streams import DUPLICATE_WINDOW_S, consumer_configs, kv_config, stream_configs
from rlbus.schemas import wire
from rlbus.schemas.config import BusConfig, OpenAIAgentConfig
from rlbus.schemas.subjects import Subjects

#: The command that regenerates the page (the test's failure message names it).
REGENERATE = "rlbus schema --docs docs/wire.md"
#: Run name of the examples: it holds a `-` to show how names are mangled into stream and bucket names.
EXAMPLE_RUN = "my-run"
#: Payload of each non-event subject (events are placed by `wire.EVENT_SUBJECT_KIND`).
SUBJECT_PAYLOADS: dict[str, type] = {"prompts": wire.PromptTask, "traj": wire.TrajectoryGroup,
                                     "weights": wire.WeightsPublished}
#: Event kinds whose subject carries one more token.
EVENT_SUBJECT_SUFFIX = {"heartbeat": ".<producer_id>"}
#: The Nats-Msg-Id each de-duplicated publish carries (the code that sets them: feeder, producer service, trainer).
MSG_IDS = {"prompts": "the task id, `e<epoch>-i<index>-a<attempt>`", "traj": "the group id (== its task id)",
           "weights": "`weights-v<version>-s<step>-<trainer process>`"}


# ------------------------------------------------------------------ the types


def wire_types() -> list[type[msgspec.Struct]]:
    """Every concrete msgspec Struct of `rlbus.schemas.wire`, in definition order (a base others extend, like
    `Wire`, is left out: it never travels alone)."""
    found = [v for v in vars(wire).values()
             if isinstance(v, type) and issubclass(v, msgspec.Struct) and v.__module__ == wire.__name__]
    return [t for t in found if not any(o is not t and issubclass(o, t) for o in found)]


def json_schema() -> dict[str, Any]:
    """One JSON Schema document: every wire type under `$defs`, and `anyOf` over the tagged message types."""
    types = wire_types()
    _, defs = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    for t in types:  # positional structs: name each array slot, since JSON Schema's prefixItems carry no names
        info = mi.type_info(t)
        if info.array_like:
            for item, f in zip(defs[t.__name__]["prefixItems"], info.fields):
                item["title"] = f.name
    tagged = [t for t in types if mi.type_info(t).tag is not None]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "rlbus wire contract",
        "description": (f"schema_version {wire.SCHEMA_VERSION}. Messages travel msgpack-encoded (bytes fields are "
                        "msgpack bin, shown here as base64 strings); see docs/wire.md."),
        "anyOf": [{"$ref": f"#/$defs/{t.__name__}"} for t in tagged],
        "$defs": defs,
    }


def _field_comments(cls: type) -> dict[str, str]:
    """`name -> trailing comment` of the field declarations of `cls` and its bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__ != wire.__name__:
            continue
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # defined where its source cannot be read (e.g. at run time): no comments
            continue
        comments = {tok.start[0]: tok.string.lstrip("#").strip()
                    for tok in tokenize.generate_tokens(io.StringIO(src).readline) if tok.type == tokenize.COMMENT}
        for node in ast.parse(src).body[0].body:  # type: ignore[attr-defined]
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.lineno in comments:
                out[node.target.id] = comments[node.lineno]
    return out


def render_type(t: mi.Type) -> str:
    """A msgspec type as a reader of the wire sees it."""
    simple = {mi.StrType: "str", mi.IntType: "int", mi.FloatType: "float", mi.BoolType: "bool",
              mi.NoneType: "null", mi.BytesType: "bytes", mi.AnyType: "any"}
    if type(t) in simple:
        return simple[type(t)]
    if isinstance(t, mi.ListType):
        return f"list[{render_type(t.item_type)}]"
    if isinstance(t, mi.DictType):
        return f"map[{render_type(t.key_type)}, {render_type(t.value_type)}]"
    if isinstance(t, mi.UnionType):
        return " \\| ".join(render_type(u) for u in t.types)
    if isinstance(t, mi.StructType):
        return f"[{t.cls.__name__}](#{t.cls.__name__.lower()})"
    if isinstance(t, mi.LiteralType):
        return " \\| ".join(json.dumps(v) for v in t.values)
    raise TypeError(f"no rendering for wire type {t!r}")


def _default(f: mi.Field) -> str:
    if f.required:
        return "required"
    if f.default_factory is not msgspec.NODEFAULT:
        factory = f.default_factory
        made = {dict: "{}", list: "[]"}.get(factory)  # type: ignore[call-overload]
        return f"`{made}`" if made else f"`{factory.__name__}()` at creation"
    return f"`{json.dumps(f.default) if not isinstance(f.default, bytes) else repr(f.default)}`"


def _where(t: type) -> str:
    s = Subjects.for_run(EXAMPLE_RUN)
    places = [f"`{getattr(s, name)}`" for name, payload in SUBJECT_PAYLOADS.items() if payload is t]
    if t in wire.EVENT_SUBJECT_KIND:
        kind = wire.EVENT_SUBJECT_KIND[t]
        places.append(f"`{s.event(kind)}{EVENT_SUBJECT_SUFFIX.get(kind, '')}`")
    if t is wire.WeightsPublished:
        places.append(f"KV bucket `{s.weights_bucket}`, key `latest`")
    if t is wire.Unacked:
        places.append(f"KV bucket `{s.weights_bucket}`, keys `{TRAINER_KEY}` and `{PRODUCERS_KEY}.<id>`")
    nested = [o.__name__ for o in wire_types() if o is not t and t in _nested_structs(o)]
    if nested:
        places.append("inside " + ", ".join(f"[{n}](#{n.lower()})" for n in nested))
    return "; ".join(places) or "not published on a subject of its own"


def _nested_structs(t: type) -> set[type]:
    out: set[type] = set()

    def walk(x: mi.Type) -> None:
        if isinstance(x, mi.StructType):
            out.add(x.cls)
        for attr in ("item_type", "key_type", "value_type"):
            if hasattr(x, attr):
                walk(getattr(x, attr))
        for u in getattr(x, "types", ()):
            walk(u)

    for f in mi.type_info(t).fields:
        walk(f.type)
    return out


def _type_section(t: type) -> list[str]:
    info = mi.type_info(t)
    doc = inspect.cleandoc(t.__doc__ or "")
    lines = [f"### {t.__name__}", "", *([doc, ""] if doc else [])]
    if info.tag is not None:
        lines.append(f"Tagged: `\"{info.tag_field}\": \"{info.tag}\"` (the tag is the map's first key). "
                     f"Where: {_where(t)}.")
    else:
        lines.append(f"Untagged. Where: {_where(t)}.")
    if info.array_like:
        lines.append("")
        lines.append("**Array-like**: encoded as a msgpack array, fields by position (the `#` column), no names.")
    lines += ["", "| # | field | type | default | meaning |" if info.array_like else "| field | type | default | meaning |",
              "|---|---|---|---|---|" if info.array_like else "|---|---|---|---|"]
    comments = _field_comments(t)
    for i, f in enumerate(info.fields):
        cells = [f"`{f.encode_name}`", render_type(f.type), _default(f), comments.get(f.name, "").replace("|", "\\|")]
        lines.append("| " + " | ".join(([str(i)] if info.array_like else []) + cells) + " |")
    return [*lines, ""]


# ------------------------------------------------------------------ the bus objects


def _subjects_table() -> list[str]:
    s = Subjects.for_run(EXAMPLE_RUN)
    streams = stream_configs(s, BusConfig())
    stream_of = {subj: sc.name for sc in streams for subj in sc.subjects}
    rows = ["| subject | stream | payload | Nats-Msg-Id |", "|---|---|---|---|"]
    for name, payload in SUBJECT_PAYLOADS.items():
        subject = getattr(s, name)
        rows.append(f"| `{subject}` | `{stream_of[subject]}` | [{payload.__name__}](#{payload.__name__.lower()}) | "
                    f"{MSG_IDS.get(name, '-')} |")
    by_kind: dict[str, list[type]] = {}
    for t, kind in wire.EVENT_SUBJECT_KIND.items():
        by_kind.setdefault(kind, []).append(t)
    for kind, types in by_kind.items():
        payloads = ", ".join(f"[{t.__name__}](#{t.__name__.lower()})" for t in types)
        rows.append(f"| `{s.event(kind)}{EVENT_SUBJECT_SUFFIX.get(kind, '')}` | `{stream_of[s.events]}` | {payloads} | - |")
    return rows


def _streams_table() -> list[str]:
    s, cfg = Subjects.for_run(EXAMPLE_RUN), BusConfig()
    rows = ["| stream | subjects | retention | storage | duplicate window | max age | replicas |",
            "|---|---|---|---|---|---|---|"]
    for sc in stream_configs(s, cfg):
        age = f"{sc.max_age:g} s" if sc.max_age else "none (`bus.max_age_s`)"
        rows.append(f"| `{sc.name}` | {', '.join(f'`{x}`' for x in sc.subjects or [])} | {sc.retention.value} | "
                    f"{sc.storage.value} | {sc.duplicate_window:g} s | {age} | {sc.num_replicas} (`bus.replicas`) |")
    kv = kv_config(s, cfg)
    rows += ["", (f"KV bucket `{kv.bucket}` (stream `KV_{kv.bucket}`): history {kv.history}, {kv.storage.value} "
                 "storage; key `latest` holds the newest WeightsPublished (msgpack, like the stream), key "
                 f"`{TRAINER_KEY}` the trainer's Unacked, `{PRODUCERS_KEY}.<id>` each named producer's.")]
    rows += ["", "| durable consumer | of stream | ack | ack wait | max deliveries | filter |", "|---|---|---|---|---|---|"]
    for stream, cc in consumer_configs(s, cfg):
        deliver = "unlimited" if cc.max_deliver == -1 else f"{cc.max_deliver} (`bus.max_deliver`)"
        rows.append(f"| `{cc.durable_name}` | `{stream}` | {cc.ack_policy.value} | {cc.ack_wait:g} s (`bus.ack_wait_s`) "
                    f"| {deliver} | `{cc.filter_subject}` |")
    return rows


def _creds_keys() -> list[str]:
    """Write a throwaway run's credentials the way the embedded server does, and describe the observer's file."""
    with tempfile.TemporaryDirectory() as d:
        creds = RunCredentials(d, EXAMPLE_RUN)
        creds.write("nats://127.0.0.1:4222")
        data = load_creds(creds.file("observer"))
    shown = {k: ("<secret>" if k == "password" else v) for k, v in data.items()}
    return [(f"`<store>/creds/<run>/<role>.json`, one per role ({', '.join(f'`{r}`' for r in ROLES)}), mode 0600; "
            f"`<store>` is `<run_dir>/bus` under `rlbus up`. The observer's file of run `{EXAMPLE_RUN}`:"), "",
            "```json", json.dumps(shown, indent=2), "```", "",
            ("Connect with `user` and `password`, and give `inbox_prefix` to the client (nats-py: "
            "`nats.connect(url, user=..., password=..., inbox_prefix=...)`): a role's permissions allow replies "
            "only on its own inbox prefix. A file may instead hold `token` (and `url`).")]


def _following() -> list[str]:
    """How an outside program follows a run: which file, which URL, the consumer recipe, how the run ends."""
    s = Subjects.for_run(EXAMPLE_RUN)
    return [
        "## Following a run",
        "",
        ("**Which file.** `rlbus up` writes two configs into the run directory, and a client needs neither for "
        "credentials. `<run_dir>/config.yaml` is the run config as given (resolved, defaults filled in; "
        "`bus.url` empty and `bus.creds_file` as given when the launcher starts its own bus). "
        "`<run_dir>/launch.yaml` is what its roles were started with: `bus.url` the embedded server's URL, "
        "`ray.address` the Ray head's, and `bus.creds_file: \"\"` (no credential is written there: each role is "
        "handed its own file on its command line). A client reads the observer's credential file, "
        "`<run_dir>/bus/creds/<run>/observer.json` (under `bus.embedded_dir` if set; `<dir>/creds/<run>/observer.json` "
        "for a server started with `rlbus bus up --dir <dir>`): it holds `url`, `user`, `password`, `run` and "
        "`inbox_prefix`, all that connecting needs. `trainer.total_steps` (the step that ends the run) is in "
        "config.yaml."),
        "",
        ("**Server URLs** in a credential file's `url`: `nats://host:port`; `tls://host:port` when the server has a "
        "certificate (connect with TLS, trusting `bus.tls_ca`); several servers of a cluster as one comma-separated "
        "list, `nats://10.0.0.1:4222,nats://10.0.0.2:4222` (each server of the cluster adds its own; give the list "
        "to the client as its servers). A server bound to every interface is written as `127.0.0.1`, an IPv6 host "
        "in brackets (`nats://[::1]:4222`). A password or token given to `rlbus up` on the command line goes to the "
        "roles as `<run_dir>/creds/bus.json`, `{\"user\", \"password\"}` or `{\"token\"}` plus `url`."),
        "",
        "**The recipe** (what examples/follow_run.py does, and what `rlbus events --follow` does):",
        "",
        "1. Connect with `user`, `password` and `inbox_prefix`, and take a JetStream context.",
        (f"2. On each stream you want, create an **ordered consumer** (ephemeral, in order, nothing to ack), naming "
         f"the stream: `js.subscribe(\"{s.events}\", stream=\"{s.events_stream}\", ordered_consumer=True, "
         f"deliver_policy=...)`. The observer may not list streams (`$JS.API.STREAM.NAMES`, which nats-py sends "
         "to find the stream of a subject when `stream=` is left out), so a subscribe without `stream=` fails "
         "with a timeout. Streams: `" + "`, `".join(
             f"{sub}` in `{stream}" for sub, stream in ((s.events, s.events_stream), (s.weights, s.weights_stream),
                                                        (s.traj, s.traj_stream))) + "`."),
        ("3. Deliver policy: `all` replays the run from its first message (the streams keep everything unless "
         "`bus.max_age_s` is set), `new` only what comes after, `last` the newest message (the current weights), "
         f"`last_per_subject` on `{s.event('heartbeat.*')}` each producer's latest heartbeat. The newest "
         f"WeightsPublished is also the KV bucket `{s.weights_bucket}`'s key `latest` (a direct get)."),
        ("4. Wait for the streams: the trainer (or `rlbus up`, before it starts any role) creates them, and until "
         "then creating a consumer answers \"stream not found\" (nats-py: `NotFoundError`). Retry every half "
         "second; an observer may not create them."),
        "5. Decode every message as msgpack, skip what does not decode or has an unknown `schema_version`.",
        "",
        (f"**How a run ends.** Each trainer, producer and evaluator process publishes `RoleStarted` when it is up "
         f"and `RoleStopped` on its way down, on `{s.event('lifecycle')}`; `role` is `trainer`, `producer` or "
         "`evaluator` (the launcher publishes only `ProducersScaled`, with the admin credential). The trainer's "
         "`RoleStopped` says why:"),
        "",
        "| `reason` | `clean` | meaning |",
        "|---|---|---|",
        "| `finished` | true | it reached `trainer.total_steps`: **the run is over** |",
        ("| `stopped` | true | stopped (SIGTERM / Ctrl-C) before the end, after a checkpoint; the same `rlbus up` "
        "resumes it |"),
        ("| `<ExceptionType>: <message>` | false | it failed (an `ErrorRaised` with `fatal: true` follows); `rlbus "
        "up` starts it again, from its last checkpoint |"),
        "",
        ("Producers and the evaluator stop with `stopped` (clean) or `<ExceptionType>: <message>` (not clean). "
         "After the trainer's `finished` the launcher stops the producers (their `stopped` follow), exports the "
         "final model and then stops the embedded server: a follower should end on the trainer's `finished` "
         "instead of waiting for more (the streams stay on disk under `<run_dir>/bus`)."),
        "",
    ]


def _endpoint() -> list[str]:
    """The OpenAI-compatible endpoint an agent of `rollout.agent_loop: openai` talks to (producers/endpoint.py)."""
    model = OpenAIAgentConfig().model
    return [
        "## The OpenAI-compatible endpoint",
        "",
        ("With `rollout.agent_loop: openai` each producer serves an HTTP endpoint for the rollouts it runs, on "
         "`rollout.openai.host` (default `127.0.0.1`) and `rollout.openai.port` (default 0: a free port). Each "
         "rollout has its own API key, valid only while the rollout runs; `http://127.0.0.1:<port>/v1` and the key "
         "reach the agent in one of two ways:"),
        "",
        ("- `rollout.openai.function: pkg.module:fn`: `async def fn(client, task) -> float | None` runs in the "
         "producer, once per sample, with an `openai.AsyncOpenAI` client holding the rollout's `base_url` and "
         "`api_key`."),
        ("- `rollout.openai.command: [argv, ...]`: a program in its own process, any language, run once per sample "
         "with `OPENAI_BASE_URL` (`http://127.0.0.1:<port>/v1`), `OPENAI_API_KEY` (the rollout's key) and "
         "`RLBUS_MODEL` (the model name) in its environment (the variables `openai` clients read by themselves), and "
         "the task on stdin as one JSON object with [PromptTask](#prompttask)'s fields (`prompt` as a list of "
         "`{role, content}`). The last non-empty line of its stdout is the reward: a JSON number, or `null` (or "
         "nothing) for `rollout.reward` to score the sequence's text. A non-zero exit fails the rollout (the tail "
         "of its stderr is in the error); past `rollout.openai.timeout_s`, or when the rollout is cancelled, the "
         "process is killed. Its key dies when it exits."),
        "",
        "| route | body | answer |",
        "|---|---|---|",
        ("| `POST /v1/chat/completions` | `model`, `messages` (system, developer, user, assistant with `tool_calls`, "
         "tool; text content), `tools` (function tools), `tool_choice`, `temperature` (> 0), `top_p`, `max_tokens` "
         "or `max_completion_tokens`, `n`, `seed`, `stop`, `stream`, `stream_options.include_usage`, `logprobs` | "
         "OpenAI's `chat.completion`, or with `stream: true` its `chat.completion.chunk` server-sent events ending "
         "in `data: [DONE]`; a reply holding tool calls the model wrote in its template's form comes back as "
         "`tool_calls` with `finish_reason: \"tool_calls\"` |"),
        ("| `POST /v1/completions` | `model`, `prompt` (a text or a list of token ids), the same sampling fields, "
         "`stop`, `stream` | `text_completion` (chunks of it when streamed) |"),
        f"| `GET /v1/models` | | the one model, `{model}` unless `rollout.openai.model` says otherwise |",
        "",
        ("- `tool_choice`: `\"none\"` gives no `tool_calls` (a call the model writes stays text); `\"required\"` "
         "or `{\"type\": \"function\", \"function\": {\"name\": ...}}` makes every reply a call: the endpoint "
         "writes the tool-call opening (`<tool_call>{\"name\": \"<fn>\", \"arguments\":`, up to the name when "
         "\"required\" leaves several tools) after the prompt, as context the model did not sample (prompt, or "
         "`response_mask` 0), and the model samples the rest with its own log-probs (no token is constrained). The "
         "call's arguments are what the model wrote, valid JSON or not, as OpenAI's (\"required\" over several "
         "tools: a reply whose call does not parse comes back as text)."),
        ("- `stop` (a string or up to 4): the reply ends before the first stop sequence its text holds, "
         "`finish_reason: \"stop\"`; the training sequence keeps exactly the tokens sampled up to the one that "
         "completed it, and a later call that continues it inserts the eos with `response_mask` 0."),
        ("- `stream: true`: sent while the reply is sampled: content deltas as the engine samples their tokens "
         "(one per token on the HF engine, one per engine step on vLLM), each tool call whole once the reply is "
         "(a chunk with its `id` and `name`, then one with its `arguments`), then a chunk with the "
         "`finish_reason`, the usage chunk if `stream_options.include_usage`, and `data: [DONE]`. Text that may "
         "yet turn out to be a tool call, a stop sequence, whitespace before a call or part of a character is "
         "held until that is known, so the deltas fold into exactly the unstreamed reply, and the capture is the "
         "same. A failure before the first delta is an HTTP error as unstreamed; one after it ends the stream "
         "with an event `data: {\"error\": {...}}` (the `openai` client raises it as an `APIError`) and no "
         "`[DONE]`. A client that closes the stream cancels the call (nothing of it is trained)."),
        "",
        ("Every request needs `Authorization: Bearer <key>`. Refusals are OpenAI's error JSON, `{\"error\": "
         "{\"message\", \"type\", \"param\", \"code\"}}`: 401 `invalid_api_key` (no key, or a key of no rollout "
         "in flight); 404 `model_not_found`; 400 naming the field for malformed messages, tools, tool_choice, stop "
         "or seed, and `temperature` 0; 400 `context_length_exceeded` when the prompt leaves no room in the model's "
         "context or in the rollout's `rollout.max_response_tokens`; 500 `engine_error` (`type: server_error`) when "
         "the engine fails under the call (its process died, say): the rollout then fails with the engine's error, "
         "its task goes back to the queue and a producer whose engine is gone stops (`rlbus up` restarts it)."),
        "",
        ("What is trained is what was sampled: each call's prompt and reply are recorded as token ids with their "
         "log-probs and weight versions. A call whose messages repeat an earlier reply of the same rollout (its text "
         "and tool calls) continues that reply's sequence with the reply's sampled ids, and only the tokens the chat "
         "template adds after it (end of turn, tool results, the next assistant header) are tokenized, with "
         "`response_mask` 0. A call that changes earlier turns starts another sequence; each sequence is a sample of "
         "the group, with the rollout's reward (the number the agent returns, or `rollout.reward` on the sequence's "
         "text when it returns None)."),
        "",
    ]


# ------------------------------------------------------------------ the page


def wire_markdown() -> str:
    s = Subjects.for_run(EXAMPLE_RUN)
    tagged = [t for t in wire_types() if mi.type_info(t).tag is not None]
    lines = [
        "# The wire contract",
        "",
        (f"Generated by `{REGENERATE}` from `schemas/wire.py`, `schemas/subjects.py`, `bus/client.py` and "
        "`bus/auth.py`; do not edit by hand (`tests/unit/test_wire_docs.py` fails when it is out of date). "
        "The same types as JSON Schema: `rlbus schema`. A client that follows a run from this page alone: "
        "`examples/follow_run.py` in the repository."),
        "",
        "## Encoding",
        "",
        (f"Every payload is one msgpack value. Messages are msgpack maps keyed by field name whose first key is the "
        f"tag `kind` ({', '.join(f'`{mi.type_info(t).tag}`' for t in tagged)}), and every one carries "
        f"`schema_version` (now {wire.SCHEMA_VERSION}). Array-like structs (below: marked **Array-like**) are "
        "msgpack arrays read by position. `bytes` is msgpack bin; times are Unix seconds as floats."),
        "",
        "## Names of a run",
        "",
        (f"Everything of run `<run>` (the config's `name`: 1-64 letters, digits, `_` or `-`) lives under the subject "
        f"prefix `rlbus.<run>.`. Stream names are `RLBUS_<RUN>_<NAME>` with the run name upper-cased and `-` turned "
        f"into `_`; the KV bucket is `rlbus_<run>_weights` with `-` turned into `_`. For run `{EXAMPLE_RUN}`: prefix "
        f"`{s.prefix}`, streams `{s.prompts_stream}`, `{s.traj_stream}`, `{s.weights_stream}`, `{s.events_stream}`, "
        f"bucket `{s.weights_bucket}`."),
        "",
        "## Subjects",
        "",
        *_subjects_table(),
        "",
        (f"`{s.events}` covers every event; `{s.event('heartbeat.*')}` every producer's heartbeat (read the last per "
        "subject for each producer's latest)."),
        "",
        "## Streams, bucket and consumers",
        "",
        (f"Created by `Bus.ensure_streams` (the trainer, or `rlbus up` as admin); defaults shown, the config keys in "
        f"brackets change them. A publish carrying `Nats-Msg-Id` is dropped as a duplicate within "
        f"{DUPLICATE_WINDOW_S:g} s of the first. Observers read with ordered (ephemeral) consumers."),
        "",
        *_streams_table(),
        "",
        "## Credentials",
        "",
        *_creds_keys(),
        "",
        *_following(),
        *_endpoint(),
        "## Evolution",
        "",
        (f"- `SCHEMA_VERSION` is {wire.SCHEMA_VERSION}; readers accept `schema_version` in "
        f"{sorted(wire.SUPPORTED_VERSIONS)} (`SUPPORTED_VERSIONS`)."),
        ("- Append-only: a new field goes last, with a default. An older reader ignores map keys it does not know and "
        "array slots past the ones it knows, so it still decodes a newer message; a newer reader fills fields an "
        "older message lacks with their defaults."),
        "- A breaking change (a field removed, renamed, retyped or reordered, a tag changed) bumps `SCHEMA_VERSION`.",
        ("- rlbus's own decoders refuse a message that does not decode into its type (a missing required field, a "
        "wrong type, an unknown tag) or whose `schema_version` they do not support: a durable consumer terminates it "
        f"and republishes it as a DeadLetter on `{s.dead_letter}`; an ordered consumer records the dead letter and "
        "goes on. A third-party reader should do the same: skip what it cannot read."),
        "",
        "## Types",
        "",
    ]
    for t in wire_types():
        lines += _type_section(t)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlbus schema", description="The wire contract: JSON Schema and docs/wire.md.")
    p.add_argument("--out", default=None, metavar="DIR", help="write DIR/wire.schema.json (default: print it)")
    p.add_argument("--docs", default=None, metavar="PATH", help="write the reference page (docs/wire.md)")
    p.add_argument("--check", default=None, metavar="PATH", help="exit 1 if PATH differs from the generated page")
    args = p.parse_args(argv)
    if args.check:
        path = Path(args.check)
        if not path.is_file() or path.read_text() != wire_markdown():
            print(f"{path} is out of date with the wire types: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    if args.docs:
        Path(args.docs).write_text(wire_markdown())
        print(args.docs)
    text = json.dumps(json_schema(), indent=2) + "\n"
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "wire.schema.json").write_text(text)
        print(out / "wire.schema.json")
    elif not args.docs:
        print(text, end="")
    return 0

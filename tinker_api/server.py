"""The Tinker API over HTTP (aiohttp): the routes the official SDK (tinker 0.38) calls, answered the way it expects.

    POST /api/v1/client/config, /client/dynamic_config     feature flags (API keys; results polled per request)
    GET  /api/v1/healthz, /get_server_capabilities         liveness (no key needed); the base model
    POST /api/v1/create_session, /session_heartbeat, /sessions/{id}/finish, /telemetry
    POST /api/v1/create_model, /get_info                   a LoRA training model on the base; its info
    POST /api/v1/forward_backward (protobuf), /optim_step  training, in seq_id order per model
    POST /api/v1/save_weights, /save_weights_for_sampler, /load_weights (into a model, or a new model from a state)
    POST /api/v1/create_sampling_session, GET /samplers/{id}, POST /asample
    POST /api/v1/retrieve_future                          long-poll of any request's result

Every route but healthz needs a key the service accepts in `X-API-Key` (the SDK sends TINKER_API_KEY there): without
one, or with another, the answer is 401 and the SDK raises `tinker.AuthenticationError`. What a key makes (sessions,
models, sampling sessions, futures, checkpoints) is found only with that key: asked for with another, it reads as
missing (404, `tinker.NotFoundError`). A request the service cannot take is answered 400 (`tinker.BadRequestError`)
at once; one that fails while it runs fails its future (`tinker.RequestFailedError`, category user or server).
Any other route is 404.

A restarted service (the same tinker.dir) restores sessions, training models and sampling sessions from their
records when a client asks for them (tinker_api/records.py says which models it can restore exactly and what a
client is told of the others). Futures do not outlive the process: a request id it does not know is answered 410,
which the SDK reads as a lost promise (a sampling client sends its request again; a training call raises).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgspec
from aiohttp import web

from rlbus.schemas.tinker import TinkerConfig
from rlbus.tinker_api import paths, proto
from rlbus.tinker_api.futures import Futures, Ordered, UserError, json_result
from rlbus.tinker_api.keys import Keys
from rlbus.tinker_api.records import ModelRecord, Records, SamplerRecord
from rlbus.tinker_api.sampling import Samplers
from rlbus.tinker_api.training import Base, TrainingModel, read_info
from rlbus.tinker_api.wire import (
    BadRequest,
    ClientConfig,
    CreateModelRequest,
    CreateSamplingSessionRequest,
    CreateSessionRequest,
    FutureRetrieveRequest,
    GetInfoRequest,
    GetInfoResponse,
    GetSamplerResponse,
    LoadWeightsRequest,
    ModelData,
    OptimStepRequest,
    SampleRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    ServerCapabilities,
    SessionHeartbeatRequest,
    SupportedModel,
    UntypedFuture,
    decode,
    encode,
)

log = logging.getLogger("rlbus.tinker")
API = "/api/v1"
OPEN_ROUTES = {f"{API}/healthz"}  # answered without a key


class NotFound(Exception):
    """Nothing of that name for this key (another key's is missing too): answered 404."""


@dataclass
class Session:
    owner: str
    last_seen: float  # monotonic time of its creation or last heartbeat
    finished: bool = False


@dataclass
class Model:
    model: TrainingModel
    ordered: Ordered  # its requests, in seq_id order
    record: ModelRecord  # what a restarted service makes it again from (records.py)


@dataclass
class SamplingSession:
    owner: str
    weights: Path | None  # the adapter directory it samples with; None: the base model
    model_path: str | None  # the tinker:// path it was made from


def _timed(fn, *args):
    """`fn(*args)` and the seconds it took, measured in the thread that runs it (no hand-off in it)."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def _json(value: object, status: int = 200) -> web.Response:
    return web.Response(body=encode(value), status=status, content_type="application/json")


class TinkerServer:
    """The routes and the state behind them: sessions, models, sampling sessions and futures, each by owner."""

    cfg: TinkerConfig
    base: Base
    samplers: Samplers
    keys: Keys
    root: Path  # tinker.dir: saved states and sampler weights, one tree per owner
    futures: Futures
    records: Records  # sessions, models and sampling sessions as a restarted service finds them
    base_url: str  # http://host:port once started
    _sessions: dict[str, Session]
    _models: dict[str, Model]
    _sampling: dict[str, SamplingSession]
    _runner: web.AppRunner | None
    _sweeper: asyncio.Task | None  # ends sessions whose client stopped sending heartbeats
    _restoring: asyncio.Lock  # one model restored at a time (each loads a state)

    def __init__(self, cfg: TinkerConfig, base: Base, keys: Keys, root: Path):
        self.cfg, self.base, self.keys, self.root = cfg, base, keys, root
        self.samplers = Samplers(base, max_samplers=cfg.max_samplers, max_batch_size=cfg.max_batch_size,
                                 max_tokens=cfg.max_tokens)  # fmt: skip
        self.futures = Futures(cfg.future_ttl_s)
        self.records = Records(root)
        self.base_url = ""
        self._sessions, self._models, self._sampling = {}, {}, {}
        self._runner = None
        self._sweeper = None
        self._restoring = asyncio.Lock()

    # ----------------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        app = web.Application(client_max_size=256 * 1024**2, middlewares=[self._guard])
        post = {"client/config": self._client_config, "client/dynamic_config": self._empty,
                "telemetry": self._telemetry, "create_session": self._create_session,
                "session_heartbeat": self._heartbeat, "sessions/{session_id}/finish": self._finish,
                "create_model": self._create_model, "get_info": self._get_info,
                "forward_backward": self._forward_backward, "optim_step": self._optim_step,
                "save_weights": self._save_weights, "save_weights_for_sampler": self._save_for_sampler,
                "load_weights": self._load_weights, "create_sampling_session": self._create_sampling_session,
                "asample": self._asample, "retrieve_future": self._retrieve}  # fmt: skip
        app.add_routes([web.post(f"{API}/{p}", h) for p, h in post.items()])
        app.add_routes([web.get(f"{API}/healthz", self._health),
                        web.get(f"{API}/get_server_capabilities", self._capabilities),
                        web.get(f"{API}/samplers/{{sampler_id}}", self._get_sampler)])  # fmt: skip
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        host, port = site._server.sockets[0].getsockname()[:2]  # the port chosen when 0 was asked for
        self.base_url = f"http://{host}:{port}"
        self._sweeper = asyncio.create_task(self._sweep())
        log.info("tinker: serving %r on %s", self.base.name, self.base_url)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await asyncio.gather(*(m.ordered.close() for m in self._models.values()))
        await self.futures.close()
        await self.samplers.close()

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path not in OPEN_ROUTES:
            owner = self.keys.owner(request.headers.get("X-API-Key"))
            if owner is None:
                return _json({"detail": "a valid API key is needed (X-API-Key: tml-...; see tinker.keys_file)"}, 401)
            request["owner"] = owner
        try:
            return await handler(request)
        except BadRequest as e:
            return _json({"detail": str(e)}, 400)
        except NotFound as e:
            return _json({"detail": str(e)}, 404)

    async def _sweep(self) -> None:
        """End the sessions whose client went away without finishing them (no heartbeat for session_timeout_s)."""
        while True:
            await asyncio.sleep(min(30.0, self.cfg.session_timeout_s / 4))
            now = asyncio.get_running_loop().time()
            for session_id, s in list(self._sessions.items()):
                if not s.finished and now - s.last_seen > self.cfg.session_timeout_s:
                    log.info("tinker: session %s sent no heartbeat for %.0f s: ended", session_id, now - s.last_seen)
                    await self._end_session(session_id, s)

    async def _end_session(self, session_id: str, s: Session) -> None:
        """A finished session's training models go (their memory and records with them); its checkpoints stay."""
        s.finished = True
        self.records.drop_session(s.owner, session_id)
        gone = [mid for mid, m in self._models.items() if m.model.session_id == session_id]
        for mid in gone:
            await self._models.pop(mid).ordered.close()
        if gone:
            log.info("tinker: session %s ended; dropped its models %s", session_id, gone)

    # ------------------------------------------------------------------------------------------------ lookups

    def _session(self, owner: str, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None and self.records.has_session(owner, session_id):  # made before a restart
            s = self._sessions[session_id] = Session(owner, asyncio.get_running_loop().time())
            log.info("tinker: session %s restored", session_id)
        if s is None or s.owner != owner:
            raise NotFound(f"session {session_id!r} not found")
        return s

    async def _model(self, owner: str, model_id: str) -> Model:
        m = self._models.get(model_id)
        if m is None:
            m = await self._restore(owner, model_id)
        if m.model.owner != owner:
            raise NotFound(f"model {model_id!r} not found")
        return m

    async def _restore(self, owner: str, model_id: str) -> Model:
        """A model made before the service restarted, from its record; NotFound if it cannot be made exactly."""
        rec = self.records.model(owner, model_id)
        if rec is None:
            raise NotFound(f"model {model_id!r} not found")
        if rec.changed:
            since = f"its last saved state {rec.state}" if rec.state else "it was made (it was never saved)"
            resume = (f"; continue from that state with create_training_client_from_state_with_optimizer"
                      f"({rec.state!r})" if rec.state else "")  # fmt: skip
            raise NotFound(f"model {model_id!r} was lost when the service stopped: it had changed since {since}, "
                           f"and that lived in memory only{resume}")
        self._session(owner, rec.session_id)
        async with self._restoring:
            if model_id not in self._models:
                src = self._checkpoint(owner, rec.state) if rec.state else None
                model = await asyncio.to_thread(self._remake, owner, model_id, rec, src)
                # the client's seq_ids go on from where they were: the first to arrive runs first
                self._models[model_id] = Model(model, Ordered(first_seq=None), rec)
                log.info("tinker: model %s restored (%s)", model_id, rec.state or "its initialisation")
        return self._models[model_id]

    def _remake(self, owner: str, model_id: str, rec: ModelRecord, src: Path | None) -> TrainingModel:
        if len(self._models) >= self.cfg.max_models:
            raise UserError(f"the service holds tinker.max_models={self.cfg.max_models} models already")
        model = TrainingModel(self.base, model_id, owner, rec.session_id, rank=rec.rank, alpha=rec.alpha,
                              train_attn=rec.train_attn, train_mlp=rec.train_mlp, seed=rec.seed)  # fmt: skip
        if src is not None:
            model.load(src, self.base, optimizer=rec.optimizer)
        return model

    def _record(self, m: Model, *, changed: bool, state: str | None = None, optimizer: bool = True) -> None:
        """Write what `m` now equals: `changed` (set before a request that changes it runs), or a `state`."""
        if changed:
            if m.record.changed:
                return  # written once until the next state
            m.record = msgspec.structs.replace(m.record, changed=True)
        else:
            m.record = msgspec.structs.replace(m.record, state=state, optimizer=optimizer, changed=False)
        self.records.save_model(m.model.owner, m.model.model_id, m.record)

    def _checkpoint(self, owner: str, path: str) -> Path:
        """The directory of `path` (tinker://...) in `owner`'s tree; NotFound if it has none."""
        d = paths.parse(path).directory(self.root, owner)
        if not d.is_dir():
            raise NotFound(f"checkpoint {path!r} not found")
        return d

    # ------------------------------------------------------------------------------------- config and sessions

    async def _health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def _client_config(self, request: web.Request) -> web.Response:
        return _json(ClientConfig())

    async def _empty(self, request: web.Request) -> web.Response:
        return _json({})

    async def _telemetry(self, request: web.Request) -> web.Response:
        return _json({"status": "accepted"})  # the SDK's usage events: taken, not kept

    async def _capabilities(self, request: web.Request) -> web.Response:
        model = SupportedModel(model_name=self.base.name, max_context_length=self.base.context_len or None)
        return _json(ServerCapabilities(supported_models=[model]))

    async def _create_session(self, request: web.Request) -> web.Response:
        decode(CreateSessionRequest, await request.read())
        session_id = uuid.uuid4().hex
        self._sessions[session_id] = Session(request["owner"], asyncio.get_running_loop().time())
        self.records.save_session(request["owner"], session_id)
        return _json({"type": "create_session", "session_id": session_id})

    async def _heartbeat(self, request: web.Request) -> web.Response:
        s = self._session(request["owner"], decode(SessionHeartbeatRequest, await request.read()).session_id)
        if s.finished:
            return _json({"detail": "session finished"}, 410)  # the SDK stops its heartbeat on 410
        s.last_seen = asyncio.get_running_loop().time()
        return _json({"type": "session_heartbeat"})

    async def _finish(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        await self._end_session(session_id, self._session(request["owner"], session_id))
        return _json({})

    # ------------------------------------------------------------------------------------------------- models

    def _new_model(self, owner: str, session_id: str, model_seq_id: int, **lora_args) -> TrainingModel:
        if len(self._models) >= self.cfg.max_models:
            raise UserError(f"the service holds tinker.max_models={self.cfg.max_models} models already")
        return TrainingModel(self.base, f"{session_id}:train:{model_seq_id}", owner, session_id,
                             alpha=self.cfg.lora_alpha, **lora_args)

    async def _create_model(self, request: web.Request) -> web.Response:
        owner, req = request["owner"], decode(CreateModelRequest, await request.read())
        self._session(owner, req.session_id)
        if req.base_model != self.base.name:
            raise BadRequest(f"base_model {req.base_model!r} is not served here; this service serves "
                             f"{self.base.name!r}")
        if req.lora_config is None:
            raise BadRequest("lora_config: required (full fine-tuning is not served here)")
        lc = req.lora_config
        if not 1 <= lc.rank <= self.cfg.max_lora_rank:
            raise BadRequest(f"lora_config.rank: must be in [1, {self.cfg.max_lora_rank}] (tinker.max_lora_rank)")
        if req.optimizer_config.type != "adamw":
            raise BadRequest(f"optimizer_config: {req.optimizer_config.type!r} is not served here (adamw is)")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        seed = lc.seed if lc.seed is not None else secrets.randbelow(2**31)  # recorded: a restart makes the same A

        async def work():
            if model_id not in self._models:  # a create sent again makes nothing new
                model = await asyncio.to_thread(self._new_model, owner, req.session_id, req.model_seq_id,
                                                rank=lc.rank, train_attn=lc.train_attn, train_mlp=lc.train_mlp,
                                                seed=seed)  # fmt: skip
                rec = ModelRecord(session_id=req.session_id, rank=lc.rank, alpha=self.cfg.lora_alpha,
                                  train_attn=lc.train_attn, train_mlp=lc.train_mlp, seed=seed)  # fmt: skip
                self.records.save_model(owner, model_id, rec)
                self._models[model_id] = Model(model, Ordered(first_seq=1), rec)
                log.info("tinker: model %s (LoRA rank %d) for %s", model_id, lc.rank, owner)
            return json_result({"model_id": model_id, "type": "create_model"})

        return _json(UntypedFuture(request_id=self.futures.run(owner, "create_model", work), model_id=model_id))

    async def _get_info(self, request: web.Request) -> web.Response:
        m = (await self._model(request["owner"], decode(GetInfoRequest, await request.read()).model_id)).model
        arch = (getattr(self.base.model.config, "architectures", None) or [None])[0]
        return _json(GetInfoResponse(model_data=ModelData(arch=arch, model_name=self.base.name,
                                                          tokenizer_id=self.base.path),
                                     model_id=m.model_id, lora_rank=m.rank, model_name=self.base.name))

    async def _submit(self, request: web.Request, model_id: str, seq_id: int | None, kind: str,
                      work) -> web.Response:  # fmt: skip
        m = await self._model(request["owner"], model_id)
        request_id = m.ordered.submit(self.futures, request["owner"], kind, seq_id, work)
        return _json(UntypedFuture(request_id=request_id, model_id=model_id))

    async def _forward_backward(self, request: web.Request) -> web.Response:
        req = proto.parse_forward_backward(await request.read(), request.headers.get("Content-Encoding", ""))
        held = await self._model(request["owner"], req.model_id)
        m = held.model
        kind = "forward" if req.forward_only else "forward_backward"

        async def work():
            if not req.forward_only:
                self._record(held, changed=True)  # its gradients live in memory until a step and a save
            (outputs, metrics), compute_s = await asyncio.to_thread(_timed, m.forward_backward, req)
            # the service's own compute time per request (bench/tinker_cost.py reads it at DEBUG)
            log.debug("tinker: %s %s seq %s compute_s=%.6f", req.model_id, kind, req.seq_id, compute_s)
            return proto.CONTENT_TYPE, proto.forward_backward_output(outputs, len(req.data), metrics)

        return await self._submit(request, req.model_id, req.seq_id, kind, work)

    async def _optim_step(self, request: web.Request) -> web.Response:
        req = decode(OptimStepRequest, await request.read())
        held = await self._model(request["owner"], req.model_id)
        if req.adam_params is None:
            raise BadRequest("optim_params: only AdamParams are served here")
        adam = req.adam_params

        async def work():
            self._record(held, changed=True)
            metrics, compute_s = await asyncio.to_thread(_timed, held.model.optim_step, adam)
            log.debug("tinker: %s optim_step seq %s compute_s=%.6f", req.model_id, req.seq_id, compute_s)
            return json_result({"metrics": metrics})

        return await self._submit(request, req.model_id, req.seq_id, "optim_step", work)

    def _save_dir(self, m: TrainingModel, kind: paths.Kind, name: str) -> tuple[paths.TinkerPath, Path]:
        tp = paths.TinkerPath(m.model_id, kind, paths.check_name(name))
        return tp, tp.directory(self.root, m.owner)

    async def _save_weights(self, request: web.Request) -> web.Response:
        req = decode(SaveWeightsRequest, await request.read())
        held = await self._model(request["owner"], req.model_id)
        m = held.model
        tp, out = self._save_dir(m, "weights", req.path or f"state-{req.seq_id or uuid.uuid4().hex[:8]}")

        async def work():
            if out.exists() and not req.overwrite:
                raise UserError(f"path: {tp} exists (pass overwrite=True to replace it)")
            await asyncio.to_thread(m.save, out, self.base, optimizer=True)
            if m.pending_grads == 0:  # pending gradients are not in a state: the model is not that state yet
                self._record(held, changed=False, state=str(tp))
            return json_result({"path": str(tp), "type": "save_weights"})

        return await self._submit(request, req.model_id, req.seq_id, "save_weights", work)

    async def _save_for_sampler(self, request: web.Request) -> web.Response:
        owner, req = request["owner"], decode(SaveWeightsForSamplerRequest, await request.read())
        m = (await self._model(owner, req.model_id)).model
        if req.kind != "snapshot":
            raise BadRequest(f"kind {req.kind!r}: only snapshot sampling clients are served here")
        tp, out = self._save_dir(m, "sampler_weights", req.path or f"snapshot-{uuid.uuid4().hex[:12]}")

        async def work():
            await asyncio.to_thread(m.save, out, self.base, optimizer=False)
            if req.path is not None:
                return json_result({"path": str(tp), "type": "save_weights_for_sampler"})
            sampling_id = self._new_sampling(owner, out, str(tp))  # save_weights_and_get_sampling_client
            return json_result({"path": str(tp), "sampling_session_id": sampling_id,
                                "type": "save_weights_for_sampler"})

        return await self._submit(request, req.model_id, req.seq_id, "save_weights_for_sampler", work)

    async def _load_weights(self, request: web.Request) -> web.Response:
        owner, req = request["owner"], decode(LoadWeightsRequest, await request.read())
        src = self._checkpoint(owner, req.path)
        if req.model_id is not None:  # into a model that exists, in its order
            held = await self._model(owner, req.model_id)
            m = held.model

            async def load():
                self._record(held, changed=True)
                await asyncio.to_thread(m.load, src, self.base, optimizer=req.optimizer)
                if req.optimizer:  # weights alone keep this model's AdamW moments: no state holds that mix
                    self._record(held, changed=False, state=req.path)
                return json_result({"path": req.path, "model_id": m.model_id, "type": "load_weights"})

            return await self._submit(request, req.model_id, req.seq_id, "load_weights", load)
        if req.session_id is None or req.model_seq_id is None:
            raise BadRequest("load_weights: give model_id and seq_id, or session_id and model_seq_id")
        self._session(owner, req.session_id)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        info = read_info(src)

        async def create():  # a new model from the state: the load is its request 0
            if model_id not in self._models:
                modules = set(info["target_modules"])
                model = await asyncio.to_thread(self._new_model, owner, req.session_id, req.model_seq_id,
                                                rank=int(info["rank"]), train_attn="q_proj" in modules,
                                                train_mlp="gate_proj" in modules)  # fmt: skip
                await asyncio.to_thread(model.load, src, self.base, optimizer=req.optimizer)
                rec = ModelRecord(session_id=req.session_id, rank=model.rank, alpha=model.lora_cfg.alpha,
                                  train_attn="q_proj" in modules, train_mlp="gate_proj" in modules, seed=0,
                                  state=req.path, optimizer=req.optimizer)  # fmt: skip
                self.records.save_model(owner, model_id, rec)
                self._models[model_id] = Model(model, Ordered(first_seq=1), rec)
            return json_result({"path": req.path, "model_id": model_id, "type": "load_weights"})

        return _json(UntypedFuture(request_id=self.futures.run(owner, "load_weights", create), model_id=model_id))

    # ----------------------------------------------------------------------------------------------- sampling

    def _new_sampling(self, owner: str, weights: Path | None, model_path: str | None) -> str:
        sampling_id = f"sampler-{uuid.uuid4().hex}"
        self._sampling[sampling_id] = SamplingSession(owner, weights, model_path)
        self.records.save_sampler(owner, sampling_id, SamplerRecord(model_path=model_path))
        return sampling_id

    def _sampler_weights(self, owner: str, model_path: str | None, base_model: str | None) -> Path | None:
        if model_path:
            return self._checkpoint(owner, model_path)
        if base_model != self.base.name:
            raise BadRequest(f"base_model {base_model!r} is not served here; this service serves {self.base.name!r}")
        return None

    async def _create_sampling_session(self, request: web.Request) -> web.Response:
        owner, req = request["owner"], decode(CreateSamplingSessionRequest, await request.read())
        self._session(owner, req.session_id)
        weights = self._sampler_weights(owner, req.model_path, req.base_model)
        sampling_id = self._new_sampling(owner, weights, req.model_path)
        return _json({"type": "create_sampling_session", "sampling_session_id": sampling_id})

    def _sampling_session(self, owner: str, sampling_id: str) -> SamplingSession:
        s = self._sampling.get(sampling_id)
        if s is None and (rec := self.records.sampler(owner, sampling_id)) is not None:  # made before a restart
            weights = self._checkpoint(owner, rec.model_path) if rec.model_path else None
            s = self._sampling[sampling_id] = SamplingSession(owner, weights, rec.model_path)
        if s is None or s.owner != owner:
            raise NotFound(f"sampling session {sampling_id!r} not found")
        return s

    async def _get_sampler(self, request: web.Request) -> web.Response:
        sampler_id = request.match_info["sampler_id"]
        s = self._sampling_session(request["owner"], sampler_id)
        return _json(GetSamplerResponse(sampler_id=sampler_id, base_model=self.base.name, model_path=s.model_path))

    async def _asample(self, request: web.Request) -> web.Response:
        owner, req = request["owner"], decode(SampleRequest, await request.read())
        if req.sampling_session_id is not None:
            weights = self._sampling_session(owner, req.sampling_session_id).weights
        else:
            weights = self._sampler_weights(owner, req.model_path, req.base_model)

        async def work():
            return proto.CONTENT_TYPE, await self.samplers.sample(weights, req)

        request_id = self.futures.run(owner, "sample", work)
        ids = [f"{request_id}:{i}" for i in range(max(req.num_samples, 0))]
        return _json(UntypedFuture(request_id=request_id, sample_sequence_ids=ids))

    async def _retrieve(self, request: web.Request) -> web.Response:
        req = decode(FutureRetrieveRequest, await request.read())
        result = await self.futures.retrieve(request["owner"], req.request_id, self.cfg.poll_s)
        if result is None:  # 410: the SDK takes the promise as lost (a sampling client sends its request again)
            return _json({"detail": f"request {req.request_id!r} not found: its result expired (tinker.future_ttl_s) "
                                    "or the service restarted since it was taken"}, 410)
        content_type, body = result
        return web.Response(body=body, content_type=content_type)

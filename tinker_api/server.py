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
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from rlbus.schemas.tinker import TinkerConfig
from rlbus.tinker_api import paths, proto
from rlbus.tinker_api.futures import Futures, Ordered, UserError, json_result
from rlbus.tinker_api.keys import Keys
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


@dataclass
class SamplingSession:
    owner: str
    weights: Path | None  # the adapter directory it samples with; None: the base model
    model_path: str | None  # the tinker:// path it was made from


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
    base_url: str  # http://host:port once started
    _sessions: dict[str, Session]
    _models: dict[str, Model]
    _sampling: dict[str, SamplingSession]
    _runner: web.AppRunner | None
    _sweeper: asyncio.Task | None  # ends sessions whose client stopped sending heartbeats

    def __init__(self, cfg: TinkerConfig, base: Base, keys: Keys, root: Path):
        self.cfg, self.base, self.keys, self.root = cfg, base, keys, root
        self.samplers = Samplers(base, max_samplers=cfg.max_samplers, max_batch_size=cfg.max_batch_size,
                                 max_tokens=cfg.max_tokens)  # fmt: skip
        self.futures = Futures(cfg.future_ttl_s)
        self.base_url = ""
        self._sessions, self._models, self._sampling = {}, {}, {}
        self._runner = None
        self._sweeper = None

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
        """A finished session's training models go (their memory with them); its checkpoints stay."""
        s.finished = True
        gone = [mid for mid, m in self._models.items() if m.model.session_id == session_id]
        for mid in gone:
            await self._models.pop(mid).ordered.close()
        if gone:
            log.info("tinker: session %s ended; dropped its models %s", session_id, gone)

    # ------------------------------------------------------------------------------------------------ lookups

    def _session(self, owner: str, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None or s.owner != owner:
            raise NotFound(f"session {session_id!r} not found")
        return s

    def _model(self, owner: str, model_id: str) -> Model:
        m = self._models.get(model_id)
        if m is None or m.model.owner != owner:
            raise NotFound(f"model {model_id!r} not found")
        return m

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

        async def work():
            if model_id not in self._models:  # a create sent again makes nothing new
                model = await asyncio.to_thread(self._new_model, owner, req.session_id, req.model_seq_id,
                                                rank=lc.rank, train_attn=lc.train_attn, train_mlp=lc.train_mlp,
                                                seed=lc.seed)  # fmt: skip
                self._models[model_id] = Model(model, Ordered(first_seq=1))
                log.info("tinker: model %s (LoRA rank %d) for %s", model_id, lc.rank, owner)
            return json_result({"model_id": model_id, "type": "create_model"})

        return _json(UntypedFuture(request_id=self.futures.run(owner, "create_model", work), model_id=model_id))

    async def _get_info(self, request: web.Request) -> web.Response:
        m = self._model(request["owner"], decode(GetInfoRequest, await request.read()).model_id).model
        arch = (getattr(self.base.model.config, "architectures", None) or [None])[0]
        return _json(GetInfoResponse(model_data=ModelData(arch=arch, model_name=self.base.name,
                                                          tokenizer_id=self.base.path),
                                     model_id=m.model_id, lora_rank=m.rank, model_name=self.base.name))

    def _submit(self, request: web.Request, model_id: str, seq_id: int | None, kind: str, work) -> web.Response:
        m = self._model(request["owner"], model_id)
        request_id = m.ordered.submit(self.futures, request["owner"], kind, seq_id, work)
        return _json(UntypedFuture(request_id=request_id, model_id=model_id))

    async def _forward_backward(self, request: web.Request) -> web.Response:
        req = proto.parse_forward_backward(await request.read(), request.headers.get("Content-Encoding", ""))
        m = self._model(request["owner"], req.model_id).model

        async def work():
            outputs, metrics = await asyncio.to_thread(m.forward_backward, req)
            return proto.CONTENT_TYPE, proto.forward_backward_output(outputs, len(req.data), metrics)

        return self._submit(request, req.model_id, req.seq_id, "forward" if req.forward_only else
                            "forward_backward", work)  # fmt: skip

    async def _optim_step(self, request: web.Request) -> web.Response:
        req = decode(OptimStepRequest, await request.read())
        m = self._model(request["owner"], req.model_id).model
        if req.adam_params is None:
            raise BadRequest("optim_params: only AdamParams are served here")
        adam = req.adam_params

        async def work():
            return json_result({"metrics": await asyncio.to_thread(m.optim_step, adam)})

        return self._submit(request, req.model_id, req.seq_id, "optim_step", work)

    def _save_dir(self, m: TrainingModel, kind: paths.Kind, name: str) -> tuple[paths.TinkerPath, Path]:
        tp = paths.TinkerPath(m.model_id, kind, paths.check_name(name))
        return tp, tp.directory(self.root, m.owner)

    async def _save_weights(self, request: web.Request) -> web.Response:
        req = decode(SaveWeightsRequest, await request.read())
        m = self._model(request["owner"], req.model_id).model
        tp, out = self._save_dir(m, "weights", req.path or f"state-{req.seq_id or uuid.uuid4().hex[:8]}")

        async def work():
            if out.exists() and not req.overwrite:
                raise UserError(f"path: {tp} exists (pass overwrite=True to replace it)")
            await asyncio.to_thread(m.save, out, self.base, optimizer=True)
            return json_result({"path": str(tp), "type": "save_weights"})

        return self._submit(request, req.model_id, req.seq_id, "save_weights", work)

    async def _save_for_sampler(self, request: web.Request) -> web.Response:
        owner, req = request["owner"], decode(SaveWeightsForSamplerRequest, await request.read())
        m = self._model(owner, req.model_id).model
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

        return self._submit(request, req.model_id, req.seq_id, "save_weights_for_sampler", work)

    async def _load_weights(self, request: web.Request) -> web.Response:
        owner, req = request["owner"], decode(LoadWeightsRequest, await request.read())
        src = self._checkpoint(owner, req.path)
        if req.model_id is not None:  # into a model that exists, in its order
            m = self._model(owner, req.model_id).model

            async def load():
                await asyncio.to_thread(m.load, src, self.base, optimizer=req.optimizer)
                return json_result({"path": req.path, "model_id": m.model_id, "type": "load_weights"})

            return self._submit(request, req.model_id, req.seq_id, "load_weights", load)
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
                self._models[model_id] = Model(model, Ordered(first_seq=1))
            return json_result({"path": req.path, "model_id": model_id, "type": "load_weights"})

        return _json(UntypedFuture(request_id=self.futures.run(owner, "load_weights", create), model_id=model_id))

    # ----------------------------------------------------------------------------------------------- sampling

    def _new_sampling(self, owner: str, weights: Path | None, model_path: str | None) -> str:
        sampling_id = f"sampler-{uuid.uuid4().hex}"
        self._sampling[sampling_id] = SamplingSession(owner, weights, model_path)
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
        if result is None:
            raise NotFound(f"request {req.request_id!r} not found (or its result expired: tinker.future_ttl_s)")
        content_type, body = result
        return web.Response(body=body, content_type=content_type)

"""The JSON half of the Tinker wire: the request bodies the SDK (tinker 0.38) posts, and the replies it validates.

Each request is decoded into its own Struct by one typed decoder (`decode(Type, body)`), never into a dict. The SDK
writes its pydantic models with `exclude_none=True`, so every optional field here has a default; fields this service
does not read are not declared, and unknown fields are ignored (the SDK adds fields between releases). Replies are
Structs encoded with `encode`; their field names are the SDK's (tinker/types/*.py).

The other half, protobuf (forward_backward requests and results, sample results), is tinker_api/proto.py.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

T = TypeVar("T")


class BadRequest(ValueError):
    """A request body the service cannot read: answered 400 with the reason."""


class _In(msgspec.Struct, kw_only=True):
    """A request body: unknown fields are ignored (forward compatible with newer SDKs)."""


# ---------------------------------------------------------------------------------------------------- sessions


class CreateSessionRequest(_In):
    sdk_version: str = ""
    tags: list[str] = []


class SessionHeartbeatRequest(_In):
    session_id: str


# ------------------------------------------------------------------------------------------------------ models


class LoraConfigIn(_In):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigIn(_In):
    type: str = "adamw"


class CreateModelRequest(_In):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: LoraConfigIn | None = None
    optimizer_config: OptimizerConfigIn = msgspec.field(default_factory=OptimizerConfigIn)


class GetInfoRequest(_In):
    model_id: str


class AdamParamsIn(_In):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepRequest(_In):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParamsIn | None = None  # the SDK writes AdamParams under this name
    optimizer_params: dict[str, Any] | None = None  # another optimizer family's (Dimuon): not served


class SaveWeightsRequest(_In):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    overwrite: bool = False


class SaveWeightsForSamplerRequest(_In):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"


class LoadWeightsRequest(_In):
    path: str
    optimizer: bool = False
    model_id: str | None = None  # a load into an existing model (with seq_id)
    seq_id: int | None = None
    session_id: str | None = None  # create-via-load: a new model (with model_seq_id)
    model_seq_id: int | None = None


# ---------------------------------------------------------------------------------------------------- sampling


class CreateSamplingSessionRequest(_In):
    session_id: str
    sampling_session_seq_id: int = 0
    base_model: str | None = None
    model_path: str | None = None


class ChunkIn(_In):
    type: str = "encoded_text"
    tokens: list[int] = []


class ModelInputIn(_In):
    chunks: list[ChunkIn]

    def to_ints(self) -> list[int]:
        other = sorted({c.type for c in self.chunks if c.type != "encoded_text"})
        if other:
            raise BadRequest(f"prompt: only encoded_text chunks are served here, not {other}")
        return [t for c in self.chunks for t in c.tokens]


class SamplingParamsIn(_In):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str | int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleRequest(_In):
    prompt: ModelInputIn
    sampling_params: SamplingParamsIn
    num_samples: int = 1
    sampling_session_id: str | None = None
    seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: dict[str, Any] | None = None


class FutureRetrieveRequest(_In):
    request_id: str
    allow_metadata_only: bool = False


# ----------------------------------------------------------------------------------------------------- replies


class _Out(msgspec.Struct, kw_only=True):
    """A reply body (every field is sent: the SDK's models take null for their optional fields)."""


class UntypedFuture(_Out):
    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


class TryAgain(_Out):
    request_id: str
    type: Literal["try_again"] = "try_again"
    queue_state: str = "active"


class RequestFailed(_Out):
    error: str
    category: Literal["user", "server", "unknown"] = "user"


class ClientConfig(msgspec.Struct, kw_only=True):
    """The SDK's feature flags as this service wants them: API keys (no JWT exchange), per-request polling of
    results, sampling retried by the SDK, custom losses run client-side (tinker/types/client_config_response.py)."""

    pjwt_auth_enabled: bool = False
    credential_default_source: str = "api_key"
    parallel_fwdbwd_chunks: bool = True
    proto_compress_fwdbwd: bool = False
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False
    sample_join_sampling_session: bool = False


class ModelData(_Out):
    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


class GetInfoResponse(msgspec.Struct, kw_only=True):
    model_data: ModelData
    model_id: str
    type: str = "get_info"
    is_lora: bool = True
    lora_rank: int | None = None
    model_name: str | None = None
    optimizer_config: dict[str, str] = msgspec.field(default_factory=lambda: {"type": "adamw"})


class SupportedModel(_Out):
    model_name: str
    max_context_length: int | None = None
    trainable: bool = True
    sampleable: bool = True


class ServerCapabilities(msgspec.Struct, kw_only=True):
    supported_models: list[SupportedModel]


class GetSamplerResponse(_Out):
    sampler_id: str
    base_model: str
    model_path: str | None = None


_encoder = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder] = {}


def decode(kind: type[T], body: bytes) -> T:
    """`body` (JSON) as a `kind`; a BadRequest names what does not fit."""
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return dec.decode(body)
    except msgspec.DecodeError as e:
        raise BadRequest(f"{kind.__name__}: {e}") from None


def encode(value: Any) -> bytes:
    return _encoder.encode(value)

